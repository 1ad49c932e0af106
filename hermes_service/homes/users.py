"""One isolated Hermes home per user (spec §用户隔离; docs/sandbox.md).

Layout under ``paths.homes_dir`` (the data dir unless set: docs/sandbox.md §Disk)::

    users/<user_id>/            HOME of the user's Hermes processes (cwd too); /home/hermes
                                inside the user's sandbox; a btrfs subvolume with a qgroup
                                limit where the disk backend is btrfs (hermes_service/disk/quota.py)
    users/<user_id>/.hermes/    HERMES_HOME: config.yaml, state.db, plugins/, ...
    users/<user_id>/.hermes-service.json   fingerprint of what was last applied

A home is made from ``users_template/`` plus the central ``hermes.model`` settings. The
provider key is never written into a home, nor given to a Hermes process: with
``provider: custom`` the home's config.yaml names ``${HERMES_SERVICE_MODEL_URL}`` and
``${HERMES_SERVICE_MODEL_KEY}``, which the launcher (:mod:`hermes_service.sandbox`) sets
per process to the service's model pass-through (:mod:`hermes_service.model_proxy`) and a
credential of that process's own. The environment built by :meth:`UserHomes.cli_env`
starts from nothing (PATH, HOME, HERMES_HOME, LANG, those two variables,
``hermes.extra_env``, NO_PROXY for loopback, and PYTHONPATH naming ``hermes_site``, whose
sitecustomize keeps a message text), so no secret of the service reaches it.

When the template or the model settings change, every home is brought up to date on its
next run (template files overwritten, user state left alone). Everything written or read
inside a home goes through :mod:`hermes_service.homefs` (never following what a user's
agent planted there).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from filelock import FileLock

from .. import homefs
from ..config import HermesSettings, PathsSettings
from ..errors import Unconfigured, check_id
from ..sandbox import MODEL_KEY_ENV, MODEL_URL_ENV
from . import state_db

MARKER = ".hermes-service.json"
log = logging.getLogger("hermes_service.user_homes")

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
#: put on the PYTHONPATH of every Hermes process: its sitecustomize turns off the CLI's
#: reading of a message that names a local image file (docs/runners.md)
HERMES_SITE = Path(__file__).resolve().parents[1] / "hermes_site"


@dataclass(frozen=True)
class UserHome:
    """Paths of one user's home: ``root`` (HOME and cwd) and ``hermes_home`` (HERMES_HOME)."""
    user_id: str
    root: Path
    hermes_home: Path


class UserHomes:
    """Creates and refreshes user homes; builds the CLI environment."""

    def __init__(self, paths: PathsSettings, hermes: HermesSettings):
        self.base = paths.homes / "users"
        self.locks = paths.data_dir / "locks"
        #: ``fn(path, mode)`` called before a home is used (the disk's: a new home made a
        #: btrfs subvolume with its quota, or its image mounted:
        #: :meth:`hermes_service.disk.quota.Disk.make_folder`), or None
        self.make_folder: Callable[..., None] | None = None
        #: ``fn(path)`` called by :meth:`path`: a home that is an image is mounted before it
        #: is read (:meth:`hermes_service.disk.quota.Disk.mount_existing`), or None
        self.mount: Callable[[Path], None] | None = None
        #: ``fn(user_id)`` run before a user's home is used (:meth:`ensure`, :meth:`present`):
        #: with shared storage, take the user's lease and restore the home when this node did
        #: not hold it (docs/scaling.md §Leases and fencing); None on a single node
        self.claim: Callable[[str], object] | None = None
        self.configure(paths, hermes)
        self.base.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)

    def configure(self, paths: PathsSettings, hermes: HermesSettings) -> None:
        """Take the template (``paths.users_template``) and the ``hermes.model``/``extra_env``
        settings (also on a live reload: every home is refreshed on its next run)."""
        self.template = paths.users_template
        self.model = hermes.model
        # an OpenAI-compatible provider is reached through the service's pass-through
        # endpoint (hermes_service/model_proxy/): no Hermes process holds its key
        self.proxied = self.model.provider == "custom"
        self.extra_env = hermes.extra_env
        # (template files' state, rendered, fingerprint)
        self._rendered_cache: tuple[tuple, dict, str] | None = None
        self.configured = self.fingerprint()     # what this configuration renders homes to

    def path(self, user_id: str) -> UserHome:
        """The home's paths (nothing created; a home that is an image mounted: :attr:`mount`).
        Raises BadRequest for an unsafe id, ``hermes_unavailable`` for an image that cannot
        be mounted."""
        check_id(user_id, "user_id")
        root = self.base / user_id
        if self.mount is not None:
            self.mount(root)
        return UserHome(user_id, root, root / ".hermes")

    # -- rendering -------------------------------------------------------
    def render_config(self) -> dict:
        """The home's config.yaml: the template's, with the central model and safety settings.

        Raises :class:`Unconfigured` if the template has no readable config.yaml.
        """
        try:
            cfg = yaml.safe_load((self.template / "config.yaml").read_text("utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise Unconfigured(f"users_template/config.yaml is unreadable: {exc}") from exc
        cfg = copy.deepcopy(cfg)
        model = dict(cfg.get("model") or {})
        model["provider"] = self.model.provider
        if self.model.base_url:
            model["base_url"] = self.model.base_url
        if self.model.default:
            model["default"] = self.model.default
        if self.model.api_key_env:
            model["api_key"] = "${%s}" % self.model.api_key_env
        if self.proxied:
            # the pass-through's address and this process's own credential, set per process
            # by the launcher (sandbox.Sandbox.prepare): never the provider or its key
            model["base_url"] = "${%s}" % MODEL_URL_ENV
            model["api_key"] = "${%s}" % MODEL_KEY_ENV
        model["context_length"] = self.model.context_length
        cfg["model"] = model
        security = dict(cfg.get("security") or {})
        security.update(allow_lazy_installs=False, tirith_enabled=False)
        cfg["security"] = security
        # Hermes's default approval mode "smart" lets an LLM approve dangerous commands with
        # no human asked: unless the template chooses, a human is required (none: denied)
        approvals = dict(cfg.get("approvals") or {})
        approvals.setdefault("mode", "manual")
        approvals.setdefault("cron_mode", "deny")
        cfg["approvals"] = approvals
        return cfg

    def fingerprint(self) -> str | None:
        """What every home is refreshed to (the rendered config and the template's files);
        None when the template is unreadable."""
        try:
            return self._fingerprint(self.render_config())
        except (Unconfigured, OSError):
            return None

    def _template_state(self) -> tuple | None:
        """Every file of the template with its inode, size and modification time (ns): what
        :meth:`_rendered` re-reads the template on; None when it cannot be listed."""
        try:
            return tuple(sorted((str(p.relative_to(self.template)), st.st_ino, st.st_size,
                                 st.st_mtime_ns)
                                for p in self.template.rglob("*")
                                if p.is_file() and (st := p.stat())))
        except OSError:
            return None

    def _rendered(self) -> tuple[dict, str]:
        """(:meth:`render_config`, its fingerprint) — parsed and hashed again only when a file
        of the template was added, removed or changed (inode, size or mtime) since the last
        time, or the settings were reloaded (:meth:`configure`): every turn calls this, and
        the YAML parse and the hash of every template file took ~10 ms of its first token.
        Raises :class:`Unconfigured` like :meth:`render_config`."""
        state = self._template_state()
        cached = self._rendered_cache
        if state is not None and cached is not None and cached[0] == state:
            return cached[1], cached[2]
        rendered = self.render_config()
        fp = self._fingerprint(rendered)
        if state is not None:
            self._rendered_cache = (state, rendered, fp)
        return rendered, fp

    def _fingerprint(self, rendered: dict) -> str:
        h = hashlib.sha256(json.dumps(rendered, sort_keys=True).encode())
        for f in sorted(p for p in self.template.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(self.template)).encode() + b"\0" + f.read_bytes())
        return h.hexdigest()

    def ensure(self, user_id: str) -> UserHome:
        """Create the home if missing, refresh it if the template/model changed; return it.

        Safe across threads and processes (a file lock per user). Raises
        BadRequest (bad id) or Unconfigured (no template).
        """
        home = self.path(user_id)
        if self.claim is not None:
            self.claim(user_id)
        return self._ensure(home)

    def present(self, user_id: str) -> UserHome:
        """The home's paths, for reading what is in it (transcripts), once it is this node's
        (:attr:`claim`); nothing created. Raises BadRequest for an unsafe id."""
        home = self.path(user_id)
        if self.claim is not None:
            self.claim(user_id)
        return home

    def ensure_system(self) -> UserHome:
        """The service's own home (``data/system-home``) for calls without a user
        (``/api/v1/status``, ``/api/v1/execute`` without ``user_context``)."""
        root = self.base.parent / "system-home"
        return self._ensure(UserHome("system", root, root / ".hermes"))

    def _ensure(self, home: UserHome) -> UserHome:
        """Bring ``home`` to the current fingerprint. The home is writable by the user's agent:
        everything here goes through :mod:`hermes_service.homefs` (no symlink, hardlink, FIFO
        or directory planted in it is followed; see :meth:`_refresh`). Raises
        :class:`~hermes_service.homefs.HomeTampered` when the home folder itself is not a
        folder."""
        rendered, fp = self._rendered()
        if self.make_folder is not None:
            home.root.parent.mkdir(parents=True, exist_ok=True)
            self.make_folder(home.root, 0o777)
        if self._current(home, fp):
            return home
        with FileLock(str(self.locks / f"home-{home.root.name}.lock"), timeout=60):
            if not self._current(home, fp):
                self._refresh(home, rendered, fp)
        return home

    def _current(self, home: UserHome, fp: str) -> bool:
        """The fast path (every turn): the marker holds ``fp``, ``.hermes`` is a folder, its
        ``config.yaml`` a plain file and no state file of SQLite's is planted — a few
        ``openat``/``fstatat`` calls, no write."""
        try:
            root = homefs.open_dirs(home.root.parent, home.root.name)
        except FileNotFoundError:
            return False
        try:
            if self._marker(root) != fp:
                return False
            try:
                hfd = homefs.open_dir(home.hermes_home.name, root)
            except (FileNotFoundError, homefs.HomeTampered):
                return False
            try:
                return homefs.plain(homefs.lstat(hfd, "config.yaml")) \
                    and not state_db.planted_state_files(hfd)
            finally:
                os.close(hfd)
        finally:
            os.close(root)

    def _refresh(self, home: UserHome, rendered: dict, fp: str) -> None:
        """Write the template's files, ``config.yaml`` and the marker into the home (holding
        its lock), repairing on the way: a symlink, file, FIFO … where a folder of the
        template belongs is removed and the folder made; a file of the service's is replaced
        by a rename inside its pinned folder, whatever had its name; planted SQLite state
        files are removed (:func:`state_db.repair_state_files`)."""
        root = homefs.open_dirs(home.root.parent, home.root.name, create=True, mode=0o777)
        try:
            hfd = homefs.open_dir(home.hermes_home.name, root, create=True, repair=True,
                                  mode=0o777, where=str(home.hermes_home))
            try:
                for src in sorted(self.template.rglob("*")):
                    rel = src.relative_to(self.template).parts
                    if not src.is_file() or rel == ("config.yaml",) or "__pycache__" in rel:
                        continue
                    self._put(hfd, rel, src.read_bytes(), home)
                removed = state_db.repair_state_files(hfd)
                if removed:
                    log.warning("home of user=%s: removed planted %s", home.user_id,
                                ", ".join(removed))
                homefs.write_file(hfd, "config.yaml",
                                  yaml.safe_dump(rendered, sort_keys=False, allow_unicode=True))
            finally:
                os.close(hfd)
            homefs.write_file(root, MARKER, json.dumps({"fingerprint": fp}))
        finally:
            os.close(root)

    @staticmethod
    def _put(hfd: int, rel: tuple[str, ...], data: bytes, home: UserHome) -> None:
        """Write template file ``rel`` (path parts under ``.hermes``) into the home."""
        fd, opened = hfd, []
        try:
            where = home.hermes_home
            for part in rel[:-1]:
                where = where / part
                fd = homefs.open_dir(part, fd, create=True, repair=True, mode=0o777,
                                     where=str(where))
                opened.append(fd)
            homefs.write_file(fd, rel[-1], data, durable=False)
        finally:
            for f in opened:
                os.close(f)

    @staticmethod
    def _marker(root_fd: int) -> str | None:
        """The fingerprint in the home's marker; None when missing, unreadable or not the
        service's plain file (the refresh then replaces it)."""
        try:
            return json.loads(homefs.read_file(root_fd, MARKER) or b"null").get("fingerprint")
        except (OSError, ValueError, AttributeError, homefs.HomeTampered):
            return None

    # -- environment -----------------------------------------------------
    def cli_env(self, home: UserHome, command_path: str, extra: dict | None = None) -> dict:
        """The CLI's whole environment, built from scratch (see module doc)."""
        env = {
            "PATH": os.pathsep.join([str(Path(command_path).parent), SAFE_PATH]),
            "HOME": str(home.root),
            "HERMES_HOME": str(home.hermes_home),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        key_env = self.model.api_key_env
        if self.proxied:
            env[MODEL_URL_ENV] = env[MODEL_KEY_ENV] = ""      # filled in per process
        elif key_env and os.environ.get(key_env) is not None:
            env[key_env] = os.environ[key_env]
        env.update(self.extra_env)
        if self.proxied:   # the pass-through is on loopback: never through an HTTP proxy
            no_proxy = [p for p in (env.get("NO_PROXY") or env.get("no_proxy") or "").split(",")
                        if p]
            env["NO_PROXY"] = env["no_proxy"] = ",".join(
                dict.fromkeys([*no_proxy, "127.0.0.1", "localhost", "::1"]))
        env.update(extra or {})
        # hermes_site/sitecustomize.py: a message is text, never a local file to attach
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERMES_SITE), env.get("PYTHONPATH"))
                                            if p)
        return env

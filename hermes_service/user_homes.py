"""One isolated Hermes home per user (issue #2 item 5; spec §用户隔离).

Layout under ``paths.data_dir``::

    users/<user_id>/            HOME of the user's CLI runs (cwd too)
    users/<user_id>/.hermes/    HERMES_HOME: config.yaml, state.db, plugins/, ...
    users/<user_id>/.hermes-service.json   fingerprint of what was last applied

A home is made from ``users_template/`` plus the central ``hermes.model``
settings. The provider key is never written into a home: config.yaml holds
``api_key: ${<api_key_env>}`` and the value reaches the CLI only through the
environment built by :meth:`UserHomes.cli_env`, which starts from nothing
(PATH, HOME, HERMES_HOME, LANG, the key variable, ``hermes.extra_env``, and
PYTHONPATH naming ``hermes_site``, whose sitecustomize keeps a message text), so
the service's own secrets never leak into the CLI.

When the template or the model settings change, every home is brought up to
date on its next run (template files overwritten, user state left alone).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml
from filelock import FileLock

from .config import Config
from .errors import Unconfigured, check_id
from .files import atomic_write

MARKER = ".hermes-service.json"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
#: put on the PYTHONPATH of every Hermes process: its sitecustomize turns off the CLI's
#: reading of a message that names a local image file (README §Runners)
HERMES_SITE = Path(__file__).resolve().parent / "hermes_site"


@dataclass(frozen=True)
class UserHome:
    """Paths of one user's home: ``root`` (HOME and cwd) and ``hermes_home`` (HERMES_HOME)."""
    user_id: str
    root: Path
    hermes_home: Path


class UserHomes:
    """Creates and refreshes user homes; builds the CLI environment."""

    def __init__(self, config: Config):
        self.base = config.data_dir / "users"
        self.locks = config.data_dir / "locks"
        self.configure(config)
        self.base.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)

    def configure(self, config: Config) -> None:
        """Take the template and the ``hermes.model``/``extra_env`` settings of ``config``
        (also on a live reload: every home is refreshed on its next run)."""
        self.template = config.users_template
        self.model = config["hermes"]["model"]
        self.extra_env = config["hermes"]["extra_env"]
        self.configured = self.fingerprint()     # what this configuration renders homes to

    def path(self, user_id: str) -> UserHome:
        """The home's paths (nothing created). Raises BadRequest for an unsafe id."""
        check_id(user_id, "user_id")
        root = self.base / user_id
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
        model["provider"] = self.model["provider"]
        if self.model.get("base_url"):
            model["base_url"] = self.model["base_url"]
        if self.model.get("default"):
            model["default"] = self.model["default"]
        if self.model.get("api_key_env"):
            model["api_key"] = "${%s}" % self.model["api_key_env"]
        model["context_length"] = self.model["context_length"]
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
        return self._ensure(self.path(user_id))

    def ensure_system(self) -> UserHome:
        """The service's own home (``data/system-home``) for calls without a user
        (``/api/v1/status``, ``/api/v1/execute`` without ``user_context``)."""
        root = self.base.parent / "system-home"
        return self._ensure(UserHome("system", root, root / ".hermes"))

    def _ensure(self, home: UserHome) -> UserHome:
        rendered = self.render_config()
        fp = self._fingerprint(rendered)
        marker = home.root / MARKER
        if self._marker(marker) == fp:
            return home
        with FileLock(str(self.locks / f"home-{home.root.name}.lock"), timeout=60):
            if self._marker(marker) == fp:
                return home
            home.hermes_home.mkdir(parents=True, exist_ok=True)
            for src in self.template.rglob("*"):
                if src.is_file() and src.name != "config.yaml" and "__pycache__" not in src.parts:
                    dst = home.hermes_home / src.relative_to(self.template)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
            atomic_write(home.hermes_home / "config.yaml",
                          yaml.safe_dump(rendered, sort_keys=False, allow_unicode=True))
            atomic_write(marker, json.dumps({"fingerprint": fp}))
        return home

    @staticmethod
    def _marker(path: Path) -> str | None:
        try:
            return json.loads(path.read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
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
        key_env = self.model.get("api_key_env")
        if key_env and os.environ.get(key_env) is not None:
            env[key_env] = os.environ[key_env]
        env.update(self.extra_env)
        env.update(extra or {})
        # hermes_site/sitecustomize.py: a message is text, never a local file to attach
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERMES_SITE), env.get("PYTHONPATH"))
                                            if p)
        return env

"""The disk: no user's agent can fill the disk others need (docs/sandbox.md §Disk).

What a sandbox can write — its home (``<homes>/users/<id>``, HOME inside), its run folder
(``<homes>/runs/<id>``) — lives under ``paths.homes_dir`` (the data dir when unset); the
service's own state (registry, run logs, usage, idempotency, page store) under
``paths.data_dir``. Three layers, each holding where the one before cannot:

A home's ``max_home_mb`` covers everything in it; of that, :func:`reserve_mb` is kept for
Hermes's own record (``.hermes``: ``state.db``, logs), so an agent that fills the home with
its files still has its turns recorded and its user can go on (the agent may delete files):
files are held at ``max_home_mb - reserve_mb`` (:attr:`Usage.files_mb`: the home but
``.hermes``, with the run folder), the whole home at ``max_home_mb``.

1. **The file system's own limit** (``hermes.sandbox.quota: auto | btrfs``): on a btrfs with
   quotas enabled, where the service may set qgroup limits (``CAP_SYS_ADMIN``: root), every
   new home is a subvolume (qgroup limit ``max_home_mb - reserve``) holding ``.hermes`` as a
   subvolume of its own, both in a level-1 qgroup limited to ``max_home_mb``; every run
   folder a subvolume of :data:`RUN_FOLDER_MB`. The kernel refuses the writer (``EDQUOT``) at
   its quota, however fast it writes (``btrfs subvolume create``, ``btrfs qgroup create /
   assign / limit``: btrfs-progs). Homes made before (plain folders) are watched (2.).
1b. **A file system per home** (``quota: auto`` where btrfs cannot, or ``image``): every new
   home an ext4 image of ``max_home_mb``, loop-mounted ``nodev,nosuid`` at its path, every
   run folder a small tmpfs (:mod:`hermes_service.disk.image`; docs/sandbox.md §Home
   images): the kernel answers ``ENOSPC`` at the quota whatever the agent does with
   descriptors. :func:`pick_backend` says which layer holds, :meth:`Disk.quota_warning`
   when ``auto`` found neither.
2. **The watcher** (every live sandbox, every mode; :mod:`hermes_service.disk.watch`): every
   50 ms it reads the free space and inodes of both file systems (``statvfs``), and
   measures each sandbox's home and run folder — with the files its processes hold open or
   mapped after their last name went (:func:`~hermes_service.disk.use.held_mb`) — at most
   every second (at most ~5 % of a core per home), and every home at once when the free
   space fell by more than what is left of a home's quota. A sandbox past its quota (files
   or whole home; on btrfs the kernel holds it, the watcher only keeps the floor) is ended:
   ``home_quota_exceeded`` (507), as is the fastest writer when space goes where no home
   shows it (a file passed through a Unix socket). When a file system falls below
   ``min_free_mb`` the sandbox that grew most during its turn, else the one writing
   fastest, is ended: ``storage_full`` (507). Each process also gets ``RLIMIT_FSIZE`` of
   what is left of its quota (:meth:`Disk.fsize_bytes`).
3. **The floor** — no turn starts while either file system is below ``min_free_mb`` (507
   ``storage_full``) or while the whole home, or its files, are at their quota (507
   ``home_quota_exceeded`` at once; the way out: ``home-trim``, docs/sandbox.md §A home at
   its quota),
   ``/health`` says ``degraded`` (503, ``checks.disk``), and a write that finds the disk full
   anyway answers 507 ``storage_full`` (the app's error handler).

:class:`Disk` is the one object: :meth:`~Disk.check_turn` before a turn, :meth:`~Disk.watch`
for each launched sandbox, :meth:`~Disk.make_folder` to create a home or run folder,
:meth:`~Disk.health`, :meth:`~Disk.describe`, :meth:`~Disk.problems`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RunError, StorageFull, Unconfigured
from ..sandbox import Launch, Settings
from . import btrfs as disk_btrfs
from . import image as disk_image
from .btrfs import BTRFS
from .image import IMAGE
from .use import STATE_FOLDER, Usage, usage
from .watch import MIB, Watcher

__all__ = ["Disk", "Space", "Usage", "home_quota_error", "reserve_mb", "space", "storage_error",
           "usage"]

log = logging.getLogger("hermes_service.disk")

#: free inodes kept (where the file system counts them: 10 000, or 5 % of a small one's)
#: below which it counts as full
MIN_FREE_INODES = 10_000
#: a run folder's qgroup limit (its files are a few KiB)
RUN_FOLDER_MB = 16
#: the qgroup of a home is refused a turn this close to its limit (MiB): Hermes must still
#: be able to write its state.db
QUOTA_HEADROOM_MB = 4
#: a home that is a file system of its own with fewer free inodes than this is full
#: (Hermes needs a few files for a turn's record)
MIN_HOME_INODES = 64
#: the layer of ``hermes.sandbox.quota`` when no kernel holds the quota
WATCH = "watch"


#: how long a measured home's usage is reused before a turn when its walk was slow (s): a
#: turn per second must not walk 100 000 files each time
REUSE_SLOW_SECONDS = 30.0
SLOW_WALK_SECONDS = 0.05
def reserve_mb(max_home_mb: float) -> float:
    """What of ``max_home_mb`` is kept for Hermes's record: an eighth, 4 to 256 MiB."""
    return max(4.0, min(256.0, max_home_mb / 8))


#: why no home images are made with shared storage (``storage.url``)
SHARED_NO_IMAGES = ("storage.url is set: a home restored from the shared storage is swapped in "
                    "by a rename, which a mounted image refuses")


def pick_backend(mode: str, homes: Path, shared: bool = False) -> tuple[str, str | None]:
    """The layer that holds ``max_home_mb`` for ``hermes.sandbox.quota`` ``mode`` on homes
    under ``homes``, and why no kernel's does (None when one does): ``auto`` takes btrfs
    qgroups where they can be set, then an image per home, then the watcher; ``btrfs`` and
    ``image`` take theirs or the watcher (:meth:`Disk.problems` then refuses to start);
    ``watch`` the watcher. ``shared`` (``storage.url`` set): no images — a restored home is
    swapped in by a rename, which a mount point refuses (docs/scaling.md §Shared storage)."""
    if mode == WATCH:
        return WATCH, "hermes.sandbox.quota is watch"
    why = []
    if mode in ("auto", BTRFS):
        no_btrfs = disk_btrfs.quota_problem(homes)
        if no_btrfs is None:
            return BTRFS, None
        why.append(no_btrfs)
    if mode in ("auto", IMAGE):
        no_image = SHARED_NO_IMAGES if shared else disk_image.image_problem(homes)
        if no_image is None:
            return IMAGE, None
        why.append(f"no home images: {no_image}")
    return WATCH, "; ".join(why)


def home_quota_error(size_mb: float, cap_mb: float, what: str = "") -> RunError:
    """``home_quota_exceeded`` (507): the home (or, ``what`` ``"files"``, its files) is at
    or over its quota; the way out is the operator's ``home-trim`` (docs/sandbox.md §A home
    at its quota)."""
    return RunError(f"the user's home uses {size_mb:.0f} MB{' of files' if what else ''}, at "
                    f"its quota of {cap_mb:g} MB (hermes.sandbox.max_home_mb"
                    f"{' less what is kept for Hermes' if what else ''}); delete files from it "
                    "(an operator: hermes-service home-trim <user_id>)",
                    code="home_quota_exceeded", status=507)


def storage_error(where: str) -> StorageFull:
    return StorageFull(f"the disk of {where} is full or below hermes.sandbox.min_free_mb; "
                       "no turn starts until an operator frees space",
                       headers={"Retry-After": "60"})


@dataclass
class Space:
    """Free space of one file system: bytes for an unprivileged writer, free and total
    inodes (None where the file system does not count them: btrfs)."""
    bytes: int
    inodes: int | None
    total_inodes: int | None = None


def space(path: Path) -> Space | None:
    """``statvfs`` of ``path``'s file system (None when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if not st.f_files:
        return Space(st.f_bavail * st.f_frsize, None)
    return Space(st.f_bavail * st.f_frsize, st.f_favail, st.f_files)


class Disk:
    """The disk rules of one service process (module doc). ``settings``: ``hermes.sandbox``;
    ``data_dir``: the service's state; ``homes``: ``paths.homes_dir`` (or the data dir)."""

    def __init__(self, settings: Settings, data_dir: Path, homes: Path, shared: bool = False):
        self.data_dir, self.homes = Path(data_dir), Path(homes)
        self.shared = shared                      # storage.url set: no home images
        self.watcher = Watcher(self)
        self._limited: dict[Path, float] = {}      # home -> the qgroup limit set (MiB)
        self._sizes: dict[Path, tuple[float, Usage]] = {}   # home -> (reuse until, usage)
        self.images = disk_image.Images(self.homes, self.data_dir / "locks")
        self.configure(settings)

    def configure(self, settings: Settings) -> None:
        """Take a (reloaded) ``hermes.sandbox`` section: quota, floor and the quota mode
        (the file system is probed again): :attr:`backend` is the layer that holds —
        ``btrfs``, ``image`` or ``watch`` — and :attr:`why_not` why it is not a kernel's
        (None when it is)."""
        self.max_home_mb = float(settings.max_home_mb)
        self.min_free = int(settings.min_free_mb * MIB)
        self.mode = mode = settings.quota
        self.backend, self.why_not = pick_backend(mode, self.homes, self.shared)

    # -- what the admin is told ------------------------------------------------------------
    def quota_warning(self) -> str | None:
        """The warning of ``check-config``, the start log and ``/health``'s ``quota`` check
        when ``quota: auto`` found no layer the kernel holds (None otherwise)."""
        if self.mode != "auto" or self.backend != WATCH:
            return None
        return (f"hermes.sandbox.quota: auto found no quota the kernel holds ({self.why_not}): "
                "only the disk watcher holds max_home_mb, and a patient writer can outrun it "
                "(docs/sandbox.md §Disk)")

    def describe(self) -> str:
        """The disk phrase of the start line and ``check-config``."""
        how = {BTRFS: f"btrfs qgroup limit per home ({self.homes})",
               IMAGE: f"a file system of its own per home (ext4 images in "
                      f"{self.homes / disk_image.IMAGE_DIR})"}.get(
            self.backend, f"watched during turns ({self.why_not})")
        apart = "" if self._same_fs() else ", homes apart from the data dir"
        return (f"max_home_mb {self.max_home_mb:g}: {how}; free-space floor "
                f"{self.min_free // MIB} MiB{apart}")

    def problems(self, source: str) -> list[str]:
        """``check-config``/start problems: ``quota: btrfs`` where it cannot hold; a
        ``paths.homes_dir`` apart from the data dir while homes are still in the data dir."""
        out = []
        if self.mode in (BTRFS, IMAGE) and self.backend != self.mode:
            out.append(f"{source}:hermes.sandbox.quota: {self.mode}, but {self.why_not}")
        old = self.data_dir / "users"
        if self.homes != self.data_dir and old.is_dir() and any(old.iterdir()):
            out.append(f"{source}:paths.homes_dir: the users' homes are still in {old}: stop "
                       f"the service and move {old} and {self.data_dir / 'system-home'} to "
                       f"{self.homes}/ (mv; across file systems rsync -aHAX), then start")
        return out

    def health(self) -> str | None:
        """``/health``'s ``disk`` check: None when both file systems are above the floor,
        else a short reason."""
        for label, path in self._filesystems():
            sp = space(path)
            if sp is not None and self._is_low(sp):
                return f"{label} below hermes.sandbox.min_free_mb"
        return None

    # -- before a turn ---------------------------------------------------------------------
    @property
    def files_cap_mb(self) -> float:
        """What a home's files (and run folder) may use: ``max_home_mb`` less the reserve."""
        return self.max_home_mb - reserve_mb(self.max_home_mb)

    def measure(self, home_root: Path, run_dir: Path) -> Usage:
        """:func:`usage` of a home, reused for :data:`REUSE_SLOW_SECONDS` when its walk took
        longer than :data:`SLOW_WALK_SECONDS` (a home of very many files)."""
        now = time.monotonic()
        cached = self._sizes.get(Path(home_root))
        if cached is not None and now < cached[0]:
            return cached[1]
        found = usage(home_root, run_dir, stop_above=self.max_home_mb + 1)
        if time.monotonic() - now > SLOW_WALK_SECONDS:
            self._sizes[Path(home_root)] = (now + REUSE_SLOW_SECONDS, found)
        else:
            self._sizes.pop(Path(home_root), None)
        return found

    def check_turn(self, home_root: Path, run_dir: Path) -> Usage:
        """Before a turn: raise ``home_quota_exceeded`` (507) when the whole home is within
        :data:`QUOTA_HEADROOM_MB` of ``max_home_mb`` (for an image: of its free space, or
        has fewer than :data:`MIN_HOME_INODES` free inodes) or
        its files within it of their cap (:attr:`files_cap_mb`: the watcher would end the
        turn at once; on btrfs the kernel keeps Hermes's room apart and the turn runs, so its
        agent can delete files), ``storage_full`` (507) when a file system is below the floor.
        Returns the home's :class:`Usage`."""
        if self.backend in (BTRFS, IMAGE) and \
                self._limited.get(Path(home_root)) != self.max_home_mb:
            self.set_limit(home_root)      # made by an earlier process, or before a reload
            self._limited[Path(home_root)] = self.max_home_mb
        used = self.measure(home_root, run_dir)
        if used.total_mb > self.max_home_mb - QUOTA_HEADROOM_MB:
            raise home_quota_error(used.total_mb, self.max_home_mb)
        if self.backend != BTRFS and used.files_mb > self.files_cap_mb - QUOTA_HEADROOM_MB:
            raise home_quota_error(used.files_mb, self.files_cap_mb, "files")
        own = space(home_root) if os.path.ismount(home_root) else None
        if own is not None and (own.bytes < QUOTA_HEADROOM_MB * MIB or
                                (own.inodes is not None and own.inodes < MIN_HOME_INODES)):
            raise home_quota_error(self.max_home_mb - own.bytes / MIB, self.max_home_mb)
        for label, path in self._filesystems():
            sp = space(path)
            if sp is not None and self._is_low(sp):
                raise storage_error(label)
        return used

    def fsize_bytes(self, used: Usage, file_size_mb: int) -> int:
        """``RLIMIT_FSIZE`` for a process of a home using ``used``: what is left of its files'
        cap, at most ``file_size_mb``, at least 1 MiB."""
        left = max(1.0, self.files_cap_mb - used.files_mb)
        return int(min(float(file_size_mb), left) * MIB)

    def make_folder(self, path: Path, mode: int = 0o700, run_folder: bool = False) -> None:
        """Before a home (or, ``run_folder``, a run folder) is used: where the backend is
        btrfs and it does not exist yet, make it subvolumes with ``mode`` and their qgroup
        limits (:func:`~hermes_service.disk.btrfs.make_home`,
        :func:`~hermes_service.disk.btrfs.make_run_folder`); where it is ``image``, have it mounted
        (:meth:`~hermes_service.disk.image.Images.ensure_home`, made when new; a run folder:
        a small tmpfs); nothing otherwise (the caller makes plain folders). What could not be
        made is made plain by the caller, and watched; raises ``hermes_unavailable`` (503)
        only when an image exists but cannot be mounted (a plain folder would hide the
        user's files) or ``quota: image`` cannot make one."""
        if self.backend == IMAGE or (not run_folder and self.has_image(path)):
            self._mount(Path(path), mode, run_folder)
            return
        if self.backend != BTRFS or os.path.lexists(path):
            return
        try:
            if run_folder:
                disk_btrfs.make_run_folder(path, mode, RUN_FOLDER_MB * MIB)
            else:
                disk_btrfs.make_home(path, STATE_FOLDER, mode, int(self.files_cap_mb * MIB),
                                     int(self.max_home_mb * MIB))
        except disk_btrfs.BtrfsFailed as exc:
            log.warning("disk: %s not made a limited btrfs subvolume: %s", path, exc)

    def has_image(self, home: Path) -> bool:
        """Is ``home`` an image (made under ``quota: image``, whatever the backend now)?"""
        return Path(home) in self.images.mounted or self.images.image(home).exists()

    def mount_existing(self, home: Path) -> None:
        """Have ``home`` mounted when it is an image (a home is read — its transcripts, its
        files — before any turn of this process); nothing otherwise. Raises
        ``hermes_unavailable`` (503) when it cannot be mounted."""
        if self.has_image(home):
            self._mount(Path(home), 0o777, False)

    def _mount(self, path: Path, mode: int, run_folder: bool) -> None:
        try:
            if run_folder:
                self.images.ensure_run_folder(path)
            elif path not in self.images.plain and \
                    not self.images.ensure_home(path, self.max_home_mb, mode):
                log.warning("disk: %s holds files made before its image: a plain folder, "
                            "watched (docs/sandbox.md §Home images)", path)
        except (disk_image.ImageFailed, OSError) as exc:
            made = not run_folder and self.images.image(path).exists()
            if self.mode == IMAGE or made:
                raise Unconfigured(f"the file system of {path.name}'s "
                                   f"{'run folder' if run_folder else 'home'} could not be "
                                   f"mounted: {exc}", code="hermes_unavailable") from None
            log.warning("disk: %s not made a file system of its own: %s", path, exc)

    def set_limit(self, path: Path) -> None:
        """Bring an existing home to ``max_home_mb`` (made by an earlier process, or a reload
        changed it): its btrfs qgroup limits, or its mounted image grown (shrinking waits
        for its next mount); nothing on a plain folder or without either."""
        if self.backend == BTRFS:
            disk_btrfs.set_home_limits(path, int(self.files_cap_mb * MIB),
                                       int(self.max_home_mb * MIB))
        elif self.backend == IMAGE and os.path.ismount(path):
            try:
                grown = self.images.grow_mounted(Path(path), self.max_home_mb)
            except (disk_image.ImageFailed, OSError) as exc:
                grown, why = False, str(exc)
            else:
                why = "smaller, or no CAP_SYS_RESOURCE to grow it mounted"
            if not grown and disk_image.size_mb(self.images.image(path)) != self.max_home_mb:
                log.info("disk: %s is resized to max_home_mb %g at its next mount (%s)",
                         path.name, self.max_home_mb, why)

    def release(self) -> list[str]:
        """The process stops: unmount the home images when no other service process on the
        data dir still uses them (:meth:`~hermes_service.disk_image.Images.release`)."""
        return self.images.release()

    # -- during a turn ---------------------------------------------------------------------
    def watch(self, launch: Launch, user_id: str, home_root: Path, run_dir: Path,
              used: Usage) -> None:
        """Watch ``launch``'s sandbox until it closes: the home ``home_root`` and run folder
        ``run_dir``, using ``used`` now (:mod:`hermes_service.disk.watch`). Past its quota or
        below the floor its :attr:`Launch.over` is set, which the runner reads as a limit
        hit."""
        self.watcher.watch(launch, user_id, home_root, run_dir, used)

    def free_space(self) -> list[tuple[str, int | None, bool]]:
        """``(label, free bytes or None, below the floor)`` of the data dir's file system and
        the homes' (when apart)."""
        out = []
        for label, path in self._filesystems():
            sp = space(path)
            out.append((label, None if sp is None else sp.bytes,
                        sp is not None and self._is_low(sp)))
        return out

    # -- helpers ---------------------------------------------------------------------------
    def _filesystems(self) -> list[tuple[str, Path]]:
        out = [("the data dir", self.data_dir)]
        if not self._same_fs():
            out.append(("the homes dir", self.homes))
        return out

    def _same_fs(self) -> bool:
        try:
            return self.homes == self.data_dir or \
                os.stat(self.homes).st_dev == os.stat(self.data_dir).st_dev
        except OSError:
            return self.homes == self.data_dir

    def _is_low(self, sp: Space) -> bool:
        if sp.bytes < self.min_free:
            return True
        return sp.inodes is not None and self.min_free > 0 and \
            sp.inodes < min(MIN_FREE_INODES, (sp.total_inodes or 0) // 20)

"""A file system of its own per home (``hermes.sandbox.quota: image``; docs/sandbox.md §Disk,
§Home images): where homes cannot get btrfs qgroup limits, each home is an ext4 in a sparse
image file, loop-mounted at the home's path, so the kernel answers a write past
``max_home_mb`` with ``ENOSPC`` — whatever the agent does with descriptors (files unlinked
while open, parked in a socket's queue, mapped).

* ``<homes>/home-images/users/<user>.img`` (the service's own home:
  ``home-images/system-home.img``): the image, sparse, of ``max_home_mb`` MiB, made with
  ``mkfs.ext4`` (e2fsprogs: no space reserved for root, the service's uid owning its root),
  mounted ``loop,nodev,nosuid,noatime,discard`` (:data:`MOUNT_OPTIONS`: files deleted in it
  free the disk below, no device node or set-uid bit in it counts). Mounted lazily, the
  first time the service touches the home in a process (:meth:`Images.ensure_home`).
* ``<homes>/runs/<user>``, the run folder: a ``tmpfs`` of :data:`RUN_FOLDER_KB` KiB
  (:meth:`Images.ensure_run_folder`) — a few marker files; memory, capped.
* a changed ``max_home_mb``: an image is grown when it is next mounted, or at once while
  mounted (``losetup -c``, ``resize2fs``); shrunk only while unmounted and when its files
  fit (``e2fsck -f``, ``resize2fs``), else kept at its size with a warning.
* two service processes on one data dir (a rolling restart): every mount and unmount is
  made holding ``locks/home-images.lock``, and each process that mounted registers
  itself (``home-images/owners/<owner>``, :func:`hermes_service.instance.current`); the
  last one to stop unmounts (:meth:`Images.release`), never one while another lives.

Every command runs with a fixed ``PATH``, ``LANG=C`` and a time limit (:data:`TIMEOUT`).
Raises :class:`ImageFailed` with the command's last line of error.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from filelock import FileLock

from .. import instance
from .btrfs import cap_sys_admin, capability, fs_type

log = logging.getLogger("hermes_service.disk")

IMAGE = "image"
IMAGE_DIR = "home-images"
#: the options of every home's mount (besides ``loop``): no device nodes, no set-uid or
#: file capabilities, no access-time writes, deleted files given back to the disk below
MOUNT_OPTIONS = ("nodev", "nosuid", "noatime", "discard")
#: a run folder's tmpfs (KiB): its marker files are a few bytes each
RUN_FOLDER_KB = 1024
RUN_FOLDER_OPTIONS = ("nodev", "nosuid", "noexec")
#: seconds any one command may take (mkfs, mount, umount, resize2fs, e2fsck)
TIMEOUT = 60
MIB = 1024 * 1024
#: ``CAP_SYS_RESOURCE``: growing a mounted ext4 (``EXT4_IOC_RESIZE_FS``) needs it
CAP_SYS_RESOURCE = 24
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_TOOLS = ("mkfs.ext4", "mount", "umount", "losetup", "resize2fs", "e2fsck")


class ImageFailed(Exception):
    """A command of :mod:`hermes_service.disk.image` failed (its message)."""


def _run(*argv: str, ok: tuple[int, ...] = (0,)) -> str:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT,
                             env={"PATH": _PATH, "LANG": "C"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageFailed(f"{argv[0]}: {exc}") from None
    if res.returncode not in ok:
        last = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        raise ImageFailed(f"{argv[0]}: {last}")
    return res.stdout


def image_problem(homes: Path) -> str | None:
    """Why homes under ``homes`` cannot be images here, or None when they can: the service
    may mount (``CAP_SYS_ADMIN``: root), the kernel has loop devices and ext4, util-linux
    and e2fsprogs are installed (``apt-get install e2fsprogs``)."""
    missing = [t for t in _TOOLS if shutil.which(t, path=_PATH) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install e2fsprogs util-linux)"
    if not cap_sys_admin():
        return "the service may not mount file systems (needs CAP_SYS_ADMIN, e.g. root)"
    if not os.path.exists("/dev/loop-control"):
        return "this host has no loop devices (/dev/loop-control)"
    try:
        if "ext4" not in Path("/proc/filesystems").read_text():
            return "this kernel has no ext4"
    except OSError:
        return "/proc/filesystems is unreadable"
    if fs_type(homes) in ("tmpfs", "ramfs", "overlay"):
        return f"{homes} is on {fs_type(homes)} (an image there would be memory or unsafe)"
    return None


def mount_options(path: Path) -> set[str] | None:
    """The options (per mount and per file system) of the mount at ``path``, or None when
    nothing is mounted there (``/proc/self/mountinfo``)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    want, found = os.path.realpath(path), None
    for line in lines:
        parts = line.split(" ")
        try:
            dash = parts.index("-")
            point = parts[4].encode().decode("unicode_escape")
        except (IndexError, ValueError):
            continue
        if point == want:      # the last one wins: the mount on top
            found = {*parts[5].split(","), *parts[dash + 3].split(","), parts[dash + 1]}
    return found


def size_mb(image: Path) -> float:
    """The size of an image file (MiB)."""
    return os.stat(image).st_size / MIB


class Images:
    """The home images under ``homes`` (``paths.homes_dir``); ``locks``: the data dir's
    lock folder (module doc)."""

    def __init__(self, homes: Path, locks: Path):
        self.dir = Path(homes) / IMAGE_DIR
        self.lock = FileLock(str(Path(locks) / "home-images.lock"), timeout=TIMEOUT * 2)
        #: mounts this process made or found (the fast path: one ``ismount`` each)
        self.mounted: set[Path] = set()
        #: homes made before as plain folders with files (this process leaves them so)
        self.plain: set[Path] = set()

    def image(self, home: Path) -> Path:
        """The image of ``home`` (``<homes>/users/<id>`` or ``<homes>/system-home``)."""
        rel = Path(home).relative_to(self.dir.parent)
        return self.dir / rel.parent / f"{rel.name}.img"

    def _register(self) -> None:
        (self.dir / "owners").mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.dir / "owners" / instance.current()).touch()

    def ensure_home(self, home: Path, mb: float, mode: int) -> bool:
        """Have ``home`` mounted from its image of ``mb`` MiB (made now for a new home; a
        plain folder with files in it, made before, stays plain: False). Raises
        :class:`ImageFailed`."""
        home = Path(home)
        if home in self.mounted and os.path.ismount(home):
            return True
        if home in self.plain:
            return False
        with self.lock:
            self._register()
            if os.path.ismount(home):
                self.mounted.add(home)
                return True
            img = self.image(home)
            if not img.exists():
                if home.is_dir() and os.listdir(home):
                    self.plain.add(home)
                    return False
                self._make(img, mb)
            else:
                self._resize_offline(img, mb)
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
            _run("mount", "-t", "ext4", "-o", ",".join(("loop", *MOUNT_OPTIONS)), str(img),
                 str(home))
            self.mounted.add(home)
            os.chmod(home, mode)
            lost = home / "lost+found"
            if lost.is_dir() and not any(os.scandir(lost)):
                lost.rmdir()
            return True

    def ensure_run_folder(self, path: Path) -> None:
        """Have run folder ``path`` mounted: a tmpfs of :data:`RUN_FOLDER_KB` KiB, 0700.
        Raises :class:`ImageFailed`."""
        path = Path(path)
        if path in self.mounted and os.path.ismount(path):
            return
        with self.lock:
            self._register()
            if not os.path.ismount(path):
                path.mkdir(parents=True, exist_ok=True, mode=0o700)
                _run("mount", "-t", "tmpfs", "-o", ",".join((
                    f"size={RUN_FOLDER_KB}k", "nr_inodes=1024", "mode=0700",
                    *RUN_FOLDER_OPTIONS)), "tmpfs", str(path))
            self.mounted.add(path)

    def _make(self, img: Path, mb: float) -> None:
        img.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = img.with_suffix(".new")
        tmp.unlink(missing_ok=True)          # (left by a process that died making it)
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, int(mb * MIB))  # sparse: takes what its files take
        finally:
            os.close(fd)
        try:
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E",
                 f"root_owner={os.geteuid()}:{os.getegid()},nodiscard", str(tmp))
            os.replace(tmp, img)
        finally:
            tmp.unlink(missing_ok=True)

    def _resize_offline(self, img: Path, mb: float) -> None:
        """Bring an unmounted image to ``mb`` MiB: grown always; shrunk when its files fit,
        else kept (a warning)."""
        have = size_mb(img)
        if abs(have - mb) < 1:
            return
        try:
            _run("e2fsck", "-f", "-p", str(img), ok=(0, 1))      # 1: errors corrected
            if mb > have:
                os.truncate(img, int(mb * MIB))
                _run("resize2fs", str(img))
            else:
                _run("resize2fs", str(img), f"{int(mb * 1024)}K")
                os.truncate(img, int(mb * MIB))
        except ImageFailed as exc:
            log.warning("disk: %s kept at %.0f MiB (max_home_mb %g): %s", img.name, have, mb,
                        exc)

    def grow_mounted(self, home: Path, mb: float) -> bool:
        """Grow a mounted home's image to ``mb`` MiB at once (``losetup -c``, then
        ``resize2fs`` online: needs ``CAP_SYS_RESOURCE``); False when it waits for its next
        mount (smaller ``mb``, no capability). Raises :class:`ImageFailed` (the image is left
        at its size)."""
        img = self.image(home)
        have = size_mb(img)
        if not os.path.ismount(home) or have >= mb - 1:
            return False
        if not capability(CAP_SYS_RESOURCE):
            return False
        with self.lock:
            device = _run("losetup", "-j", str(img)).split(":", 1)[0].strip()
            if not device.startswith("/dev/loop"):
                return False
            os.truncate(img, int(mb * MIB))
            try:
                _run("losetup", "-c", device)
                _run("resize2fs", device)
            except ImageFailed:
                os.truncate(img, int(have * MIB))
                _run("losetup", "-c", device)
                raise
        return True

    def release(self) -> list[str]:
        """This process stops: unregister it, and — when no other live process registered —
        unmount every home and run folder mounted from here (one still busy stays mounted,
        with a warning). Returns the paths unmounted."""
        done: list[str] = []
        owners = self.dir / "owners"
        if not owners.is_dir():
            return done
        with self.lock:
            (owners / instance.current()).unlink(missing_ok=True)
            others = [p for p in owners.iterdir() if instance.alive(p.name)]
            for p in owners.iterdir():
                if p not in others:
                    p.unlink(missing_ok=True)
            if others:
                return done
            for point in self.mount_points():
                try:
                    _run("umount", str(point))
                    done.append(str(point))
                except ImageFailed as exc:
                    log.warning("disk: %s stays mounted: %s", point, exc)
            self.mounted.clear()
        return done

    def mount_points(self) -> list[Path]:
        """Homes and run folders mounted now from this folder's images (and run tmpfs)."""
        homes = self.dir.parent
        out = []
        for parent in (homes / "users", homes / "runs"):
            try:
                names = sorted(os.listdir(parent))
            except OSError:
                continue
            out += [parent / n for n in names if os.path.ismount(parent / n)]
        sys_home = homes / "system-home"
        return [*out, *([sys_home] if os.path.ismount(sys_home) else [])]

    def orphans(self) -> list[Path]:
        """Images whose home folder is gone (its user removed by an operator) and that no
        mount uses: what ``gc`` removes."""
        out = []
        for img in sorted([*self.dir.glob("users/*.img"), *self.dir.glob("*.img")]):
            home = self.dir.parent / img.relative_to(self.dir).with_suffix("")
            if not os.path.lexists(home):
                used = _run("losetup", "-j", str(img)).strip()
                if not used:
                    out.append(img)
        return out

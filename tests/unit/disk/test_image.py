"""The home images' rules (hermes_service/disk/image.py, disk/quota.py; docs/sandbox.md §Home
images): which layer ``quota: auto`` picks, and — with real mkfs.ext4 and loop mounts, where
the service may mount (root) — each image's size, its mount options, the run folder's tmpfs,
resizing, the last process out unmounting, and ``gc``'s orphans. Real Hermes turns against
images: tests/e2e/test_e2e_disk_image.py."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hermes_service import instance
from hermes_service.disk import btrfs as disk_btrfs
from hermes_service.disk import image as disk_image
from hermes_service.disk import quota as disk
from hermes_service.disk.image import MIB, image_problem, mount_options
from hermes_service.disk.quota import Disk, pick_backend
from hermes_service.errors import RunError
from hermes_service.homes import trim as home_trim
from hermes_service.sandbox import Settings

NO_IMAGES = image_problem(Path("/var/tmp"))
needs_mounts = pytest.mark.skipif(NO_IMAGES is not None,
                                  reason=f"no loop mounts here: {NO_IMAGES}")


def test_auto_takes_btrfs_then_an_image_then_the_watcher_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(disk_btrfs, "quota_problem", lambda p: None)
    monkeypatch.setattr(disk_image, "image_problem", lambda p: None)
    assert pick_backend("auto", tmp_path) == ("btrfs", None)
    assert pick_backend("image", tmp_path) == ("image", None)
    monkeypatch.setattr(disk_btrfs, "quota_problem", lambda p: "not on btrfs")
    assert pick_backend("auto", tmp_path) == ("image", None)
    assert pick_backend("btrfs", tmp_path) == ("watch", "not on btrfs")
    monkeypatch.setattr(disk_image, "image_problem", lambda p: "not root")
    backend, why = pick_backend("auto", tmp_path)
    assert backend == "watch" and "not on btrfs" in why and "not root" in why
    assert pick_backend("watch", tmp_path)[0] == "watch"
    # the fallback is said (start log, check-config, /health); quota: image refuses to start
    d = Disk(Settings(quota="auto"), tmp_path, tmp_path)
    assert d.backend == "watch" and "only the disk watcher" in d.quota_warning()
    assert d.problems("c.yaml") == []
    assert Disk(Settings(quota="watch"), tmp_path, tmp_path).quota_warning() is None
    refused = Disk(Settings(quota="image"), tmp_path, tmp_path).problems("c.yaml")
    assert refused == ["c.yaml:hermes.sandbox.quota: image, but no home images: not root"]


def test_images_need_root_loop_devices_and_a_disk_not_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(disk_image, "cap_sys_admin", lambda: False)
    assert "CAP_SYS_ADMIN" in image_problem(tmp_path)
    monkeypatch.setattr(disk_image, "cap_sys_admin", lambda: True)
    monkeypatch.setattr(disk_image, "fs_type", lambda p: "tmpfs")
    assert "tmpfs" in image_problem(tmp_path)


@pytest.fixture
def images(tmp_path):
    """Homes on a disk (not tmpfs: /var/tmp), unmounted whatever a test left."""
    root = Path(subprocess.run(["mktemp", "-d", "-p", "/var/tmp"], capture_output=True,
                               text=True, check=True).stdout.strip())
    yield root
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split(" ")[4]
        if point.startswith(str(root)):
            subprocess.run(["umount", point], capture_output=True)
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)])


def disk_of(root: Path, mb: float = 32, quota: str = "image") -> Disk:
    d = Disk(Settings(quota=quota, max_home_mb=mb, min_free_mb=0), root / "data", root)
    (root / "data" / "locks").mkdir(parents=True, exist_ok=True)
    return d


@needs_mounts
def test_a_home_is_an_image_of_max_home_mb_mounted_nodev_nosuid(images):
    d = disk_of(images)
    assert d.backend == "image" and "ext4 images" in d.describe()
    home = images / "users" / "u"
    d.make_folder(home, 0o777)
    img = images / "home-images" / "users" / "u.img"
    assert os.path.ismount(home) and img.stat().st_size == 32 * MIB
    assert img.stat().st_blocks * 512 < 8 * MIB                      # sparse
    opts = mount_options(home)
    assert {"nodev", "nosuid", "ext4"} <= opts, opts
    assert (os.stat(home).st_mode & 0o777, os.stat(home).st_uid) == (0o777, os.geteuid())
    assert not (home / "lost+found").exists()
    run = images / "runs" / "u"
    d.make_folder(run, 0o700, run_folder=True)
    opts = mount_options(run)
    assert {"nodev", "nosuid", "noexec", "tmpfs"} <= opts, opts
    # the kernel refuses a write past the image: ENOSPC, not a watcher's look later
    with pytest.raises(OSError) as err, open(home / "big", "wb") as f:
        for _ in range(40):
            f.write(b"\1" * MIB)
            f.flush()
    assert err.value.errno == 28
    (home / "big").unlink()
    with pytest.raises(OSError), open(run / "big", "wb") as f:       # 1 MiB of run folder
        f.write(b"\1" * (2 * MIB))


@needs_mounts
def test_a_plain_home_made_before_stays_plain_and_an_image_is_never_hidden(images):
    home = images / "users" / "old"
    home.mkdir(parents=True)
    (home / "notes.txt").write_text("kept")
    d = disk_of(images)
    d.make_folder(home, 0o777)
    assert not os.path.ismount(home) and (home / "notes.txt").read_text() == "kept"
    # an image that exists but cannot be mounted: 503, never a plain folder over it
    bad = images / "users" / "bad"
    (images / "home-images" / "users").mkdir(parents=True, exist_ok=True)
    (images / "home-images" / "users" / "bad.img").write_bytes(b"not ext4")
    with pytest.raises(Exception) as err:
        d.mount_existing(bad)
    assert getattr(err.value, "code", None) == "hermes_unavailable"


@needs_mounts
def test_an_image_grows_and_shrinks_with_max_home_mb_only_when_its_files_fit(images):
    home = images / "users" / "u"
    disk_of(images, 32).make_folder(home, 0o777)
    grown = disk_of(images, 48)
    grown.set_limit(home)          # mounted: grown at once (with CAP_SYS_RESOURCE), else
    img = images / "home-images" / "users" / "u.img"       # at its next mount
    if not disk_btrfs.capability(disk_image.CAP_SYS_RESOURCE):
        assert img.stat().st_size == 32 * MIB
        assert grown.release() and not os.path.ismount(home)
        grown.mount_existing(home)
    assert img.stat().st_size == 48 * MIB
    assert os.statvfs(home).f_blocks * os.statvfs(home).f_frsize > 36 * MIB
    with open(home / "fill", "wb") as f:
        f.write(b"\1" * 30 * MIB)
    assert disk_of(images, 48).release()                   # the last process: unmounted
    assert not os.path.ismount(home)
    disk_of(images, 24).mount_existing(home)               # its 30 MiB do not fit: kept
    assert img.stat().st_size == 48 * MIB and (home / "fill").stat().st_size == 30 * MIB
    (home / "fill").unlink()
    disk_of(images, 24).release()
    disk_of(images, 24).mount_existing(home)               # they fit now: shrunk
    assert img.stat().st_size == 24 * MIB and os.path.ismount(home)


@needs_mounts
def test_the_last_process_out_unmounts_and_gc_finds_a_removed_users_image(images):
    d = disk_of(images)
    home = images / "users" / "u"
    d.make_folder(home, 0o777)
    other = images / "home-images" / "owners" / f"{os.getppid()}-{instance.proc_start(os.getppid())}"
    other.touch()                                          # another live service process
    assert d.release() == [] and os.path.ismount(home)
    other.unlink()
    d.make_folder(home, 0o777)
    assert d.release() == [str(home)] and not os.path.ismount(home)
    assert d.images.orphans() == []
    home.rmdir()                                           # an operator removed the user
    assert d.images.orphans() == [images / "home-images" / "users" / "u.img"]


@needs_mounts
def test_a_home_at_its_files_cap_is_507_at_once_and_home_trim_is_the_way_out(images):
    d = disk_of(images, 64)
    home, run = images / "users" / "u", images / "runs" / "u"
    d.make_folder(home, 0o777)
    d.make_folder(run, 0o700, run_folder=True)
    st = os.statvfs(home)          # (the file system's own journal and tables take ~12 %)
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize - MIB), str(home / "big.bin")],
                   check=True)
    with pytest.raises(RunError) as err:
        d.check_turn(home, run)
    assert (err.value.status, err.value.code) == (507, "home_quota_exceeded")
    assert next(e.path for e in home_trim.largest(home)) == "big.bin"
    for bad in ("/etc/passwd", "../x", ".hermes/state.db", ""):
        with pytest.raises(home_trim.BadPath):
            home_trim.remove(home, bad)
    assert home_trim.remove(home, "big.bin") and not home_trim.remove(home, "big.bin")
    assert d.check_turn(home, run).files_mb < 1


def test_the_whole_image_full_is_507_even_when_no_walk_shows_it(monkeypatch, tmp_path):
    home = tmp_path / "users" / "u"
    home.mkdir(parents=True)
    d = Disk(Settings(quota="watch", max_home_mb=64, min_free_mb=0), tmp_path, tmp_path)
    monkeypatch.setattr(disk.os.path, "ismount", lambda p: Path(p) == home)
    monkeypatch.setattr(disk, "space", lambda p: disk.Space(MIB, 100, 1000))
    with pytest.raises(RunError) as err:                   # (unlinked files held open)
        d.check_turn(home, tmp_path / "runs" / "u")
    assert err.value.code == "home_quota_exceeded"


def test_health_says_degraded_200_when_auto_found_only_the_watcher(app_factory, monkeypatch):
    monkeypatch.setattr(disk_btrfs, "quota_problem", lambda p: "not on btrfs")
    monkeypatch.setattr(disk_image, "image_problem", lambda p: "not root")
    res = app_factory({"hermes": {"sandbox": {"quota": "auto"}}}).test_client().get("/health")
    assert res.status_code == 200 and res.json["status"] == "degraded", res.json
    assert res.json["checks"]["quota"] != "ok" and res.json["checks"]["disk"] == "ok"


def test_files_at_their_cap_are_refused_where_the_watcher_holds_them_not_on_btrfs(
        monkeypatch, tmp_path):
    home, run = tmp_path / "users" / "u", tmp_path / "runs" / "u"
    home.mkdir(parents=True)
    with open(home / "files.bin", "wb") as f:
        f.write(b"\1" * 27 * MIB)                         # the cap of 32: 28
    watched = Disk(Settings(quota="watch", max_home_mb=32, min_free_mb=0), tmp_path, tmp_path)
    with pytest.raises(RunError) as err:
        watched.check_turn(home, run)
    assert err.value.code == "home_quota_exceeded"
    monkeypatch.setattr(disk_btrfs, "quota_problem", lambda p: None)
    monkeypatch.setattr(disk_btrfs, "set_home_limits", lambda *a: None)
    on_btrfs = Disk(Settings(quota="btrfs", max_home_mb=32, min_free_mb=0), tmp_path, tmp_path)
    assert on_btrfs.check_turn(home, run).files_mb >= 27   # Hermes's room is the kernel's


@pytest.mark.parametrize("mode", ["auto", "image"])
def test_no_home_images_with_shared_storage(tmp_path, mode):
    # a restored home is swapped in by a rename, which a mount point refuses
    from hermes_service.disk.quota import SHARED_NO_IMAGES, WATCH, pick_backend
    backend, why = pick_backend(mode, tmp_path, shared=True)
    assert backend == WATCH and SHARED_NO_IMAGES in why

"""The disk floor's edge (hermes_service/disk/quota.py, docs/sandbox.md §Disk): a file system with
less free space than ``hermes.sandbox.min_free_mb`` refuses a turn, with more it does not —
at the floor itself, not at a fraction of it. The rest of the quota's rules:
disk/test_quota.py."""
from __future__ import annotations

import pytest

from hermes_service.disk import quota as disk
from hermes_service.disk.quota import Disk, Space
from hermes_service.errors import StorageFull
from hermes_service.sandbox import Settings

MIB = 1024 * 1024


def test_a_turn_is_refused_just_below_the_floor_and_taken_just_above(tmp_path, monkeypatch):
    home, run = tmp_path / "data" / "users" / "u", tmp_path / "data" / "runs" / "u"
    home.mkdir(parents=True)
    d = Disk(Settings(quota="watch", max_home_mb=32, min_free_mb=64),
             tmp_path / "data", tmp_path / "data" / "users")
    monkeypatch.setattr(disk, "space", lambda p: Space(63 * MIB, 10**6, 10**7))
    with pytest.raises(StorageFull):
        d.check_turn(home, run)
    monkeypatch.setattr(disk, "space", lambda p: Space(65 * MIB, 10**6, 10**7))
    assert d.check_turn(home, run).total_mb < 1


def _write(path, mib: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\1" * int(mib * MIB))


def test_the_watcher_kills_a_sandbox_whose_files_pass_their_cap(tmp_path):
    """The files' cap is ``max_home_mb`` less the record's reserve (32 - 4 MiB): files of
    30 MiB end the sandbox though the whole home (30 MiB) is under 32 — and its processes
    inside are killed, not only marked."""
    import subprocess

    from hermes_service.sandbox import Launch
    from support.fixtures import wait_for
    home, run = tmp_path / "data" / "users" / "u", tmp_path / "data" / "runs" / "u"
    _write(home / "start.bin", 1)
    d = Disk(Settings(quota="watch", max_home_mb=32, min_free_mb=0), tmp_path / "data",
             tmp_path / "data")
    # the sandbox: its leader (bwrap's stand-in) and a process inside it
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        launch = Launch(["sleep"], {}, "/", pid=proc.pid)
        d.watch(launch, "u", home, run, d.measure(home, run))
        _write(home / "grow.bin", 29)
        wait_for(lambda: launch.limit_hit() == "home_quota", "the sandbox ended", 20)
        proc.wait(20)                  # what ran inside was killed: its leader ends
        launch.close()
    finally:
        proc.kill()
        proc.wait()


def test_below_the_floor_a_sandbox_that_grew_little_is_spared(tmp_path, monkeypatch):
    from hermes_service.sandbox import Launch
    from support.fixtures import wait_for
    d = Disk(Settings(quota="watch", max_home_mb=4096, min_free_mb=64), tmp_path / "data",
             tmp_path / "data")
    home, run = tmp_path / "data" / "users" / "s", tmp_path / "data" / "runs" / "s"
    _write(home / "x.bin", 1)
    launch = Launch(["true"], {}, "/")
    d.watch(launch, "s", home, run, d.measure(home, run))
    _write(home / "more.bin", 2)                       # under GROWTH_MB (16)
    looks = []

    def space(path):
        looks.append(path)
        return Space(MIB, None)
    monkeypatch.setattr(disk, "space", space)
    wait_for(lambda: len(looks) >= 7, "three passes of the watcher below the floor", 20)
    assert launch.limit_hit() is None
    launch.close()

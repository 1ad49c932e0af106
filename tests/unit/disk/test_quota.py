"""The disk rules (hermes_service/disk/quota.py; docs/sandbox.md §Disk) without Hermes: what a
home uses and what is kept for Hermes's record, the checks before a turn, the watcher ending a
sandbox past its quota or below the floor, what the operator is told — and a full disk
answered 507 by the app, never 500. On real file systems with real sandboxes:
tests/e2e/test_e2e_disk.py."""
from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

import pytest

from hermes_service import errors
from hermes_service.disk import btrfs as disk_btrfs
from hermes_service.disk import quota as disk
from hermes_service.disk.quota import Disk, Space, Usage, reserve_mb, usage
from hermes_service.errors import RunError, StorageFull
from hermes_service.sandbox import Launch, Settings
from support.fixtures import wait_for

MIB = 1024 * 1024


def write(path: Path, mib: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\1" * int(mib * MIB))


def make(tmp_path, **kw) -> Disk:
    settings = Settings(quota="watch", **{"max_home_mb": 32, "min_free_mb": 0, **kw})
    return Disk(settings, tmp_path / "data", tmp_path / "data")


def test_a_home_is_its_files_and_hermess_record_and_a_reserve_is_kept_for_the_record(tmp_path):
    home, run = tmp_path / "users" / "u", tmp_path / "runs" / "u"
    write(home / "a.bin", 3)
    write(home / ".hermes" / "state.db", 2)
    write(run / "r.json", 1)
    used = usage(home, run)
    assert 4 <= used.files_mb < 4.2 and 2 <= used.state_mb < 2.2
    assert used.total_mb == used.files_mb + used.state_mb
    assert (reserve_mb(32), reserve_mb(2048), reserve_mb(1 << 20)) == (4, 256, 256)
    d = make(tmp_path)
    assert d.files_cap_mb == 28
    assert d.fsize_bytes(Usage(27.5, 1), 512) == MIB               # at least 1 MiB
    assert d.fsize_bytes(Usage(8, 1), 512) == 20 * MIB             # what is left of the cap
    assert d.fsize_bytes(Usage(0, 0), 8) == 8 * MIB                # file_size_mb first


def test_a_turn_is_refused_at_once_at_the_whole_quota_at_the_files_cap_or_below_the_floor(
        tmp_path, monkeypatch):
    home, run = tmp_path / "data" / "users" / "u", tmp_path / "data" / "runs" / "u"
    write(home / "files.bin", 20)                  # its files below their cap: turns go on
    d = make(tmp_path)
    assert d.check_turn(home, run).files_mb >= 20
    write(home / "more.bin", 7)                    # its files at their cap (28): 507 at once
    with pytest.raises(RunError) as err:           # (the watcher would end it at its start)
        d.check_turn(home, run)
    assert (err.value.status, err.value.code) == (507, "home_quota_exceeded")
    assert "of files" in str(err.value) and "home-trim" in str(err.value)
    (home / "more.bin").unlink()
    write(home / ".hermes" / "state.db", 9)        # the whole home at its quota: refused
    with pytest.raises(RunError) as err:
        d.check_turn(home, run)
    assert (err.value.status, err.value.code) == (507, "home_quota_exceeded")
    (home / ".hermes" / "state.db").unlink()
    d = make(tmp_path, min_free_mb=64)
    monkeypatch.setattr(disk, "space", lambda p: Space(10 * MIB, 1000, 100000))
    with pytest.raises(StorageFull) as err:
        d.check_turn(home, run)
    assert (err.value.status, err.value.code) == (507, "storage_full")
    assert d.health() == "the data dir below hermes.sandbox.min_free_mb"
    monkeypatch.setattr(disk, "space", lambda p: Space(1 << 40, 500, 100000))   # no inodes
    assert d.health() is not None
    monkeypatch.setattr(disk, "space", lambda p: Space(1 << 40, None))          # btrfs: none
    assert d.health() is None and d.check_turn(home, run)


def test_the_watcher_ends_a_sandbox_past_its_quota_and_forgets_it_when_it_closes(tmp_path):
    home, run = tmp_path / "data" / "users" / "u", tmp_path / "data" / "runs" / "u"
    write(home / "start.bin", 1)
    d = make(tmp_path)
    launch = Launch(["true"], {}, "/")
    d.watch(launch, "u", home, run, d.measure(home, run))
    write(home / "grow.bin", 40)                   # faster than its room: measured at once
    wait_for(lambda: launch.limit_hit() == "home_quota", "the sandbox ended", 10)
    launch.close()
    assert not len(d.watcher)


def test_below_the_floor_the_sandbox_that_grew_most_is_ended(tmp_path, monkeypatch):
    d = make(tmp_path, max_home_mb=4096, min_free_mb=64)
    homes = {n: (tmp_path / "data" / "users" / n, tmp_path / "data" / "runs" / n)
             for n in ("small", "big")}
    launches = {}
    for n, (home, run) in homes.items():
        write(home / "x.bin", 1)
        launches[n] = Launch(["true"], {}, "/")
        d.watch(launches[n], n, home, run, d.measure(home, run))
    write(homes["small"][0] / "more.bin", 2)
    write(homes["big"][0] / "more.bin", 40)
    monkeypatch.setattr(disk, "space", lambda p: Space(MIB, None))
    wait_for(lambda: launches["big"].limit_hit() == "disk", "the big writer ended", 10)
    assert launches["small"].limit_hit() is None       # grew by less than GROWTH_MB: spared
    for launch in launches.values():
        launch.close()


#: a sandbox's process: writes MiB into a file it unlinked (or made with O_TMPFILE, or sent
#: through a Unix socket and closed), then waits for its stdin to close (or, "forever",
#: writes on in place as fast as it can)
HIDER = r"""
import os, socket, sys
where, how, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
if how == "tmpfile":
    fd = os.open(where, os.O_TMPFILE | os.O_WRONLY, 0o600)
else:
    fd = os.open(os.path.join(where, "h"), os.O_CREAT | os.O_WRONLY, 0o600)
    os.unlink(os.path.join(where, "h"))
a, b = socket.socketpair()
for _ in range(mib):
    os.write(fd, b"\1" * (1 << 20))
    if how == "in-flight":             # out of every /proc/<pid>/fd: only its writes show
        socket.send_fds(a, [b"x"], [fd])
        os.close(fd)
        fd = os.open(where, os.O_TMPFILE | os.O_WRONLY, 0o600) if False else \
            os.open(os.path.join(where, "h"), os.O_CREAT | os.O_WRONLY, 0o600)
        os.unlink(os.path.join(where, "h"))
print("ready", flush=True)
if len(sys.argv) > 4:                  # writing on, fast, in place: no more space taken
    while True:
        os.pwrite(fd, b"\1" * (1 << 20), 0)
sys.stdin.read()
"""


def hider(folder: Path, how: str, mib: int, forever: bool = False):
    import subprocess
    import sys
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", HIDER, str(folder), how, str(mib),
                             *(["forever"] if forever else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


@pytest.mark.parametrize("how", ["unlinked", "tmpfile"])
def test_files_a_sandbox_holds_without_a_name_count_toward_its_quota(tmp_path, how):
    home, run = tmp_path / "data" / "users" / "u", tmp_path / "data" / "runs" / "u"
    write(home / "start.bin", 1)
    d = make(tmp_path)
    proc = hider(home, how, 40)
    try:
        assert proc.stdout.readline() == b"ready\n"
        launch = Launch(["true"], {}, "/")
        launch.pid = proc.pid
        d.watch(launch, "u", home, run, d.measure(home, run))
        wait_for(lambda: launch.limit_hit() == "home_quota", "the hider ended", 10)
        launch.close()
    finally:
        proc.kill()
        proc.wait()


def watch_quiet_and_writer(d, tmp_path, stack: contextlib.ExitStack) -> dict:
    """Two watched sandboxes, each holding 1 MiB unlinked: "quiet" then writes no more,
    "writer" writes on. Returns their launches; closing ``stack`` ends both."""
    launches = {}
    for n in ("quiet", "writer"):
        home, run = tmp_path / "data" / "users" / n, tmp_path / "data" / "runs" / n
        write(home / "x.bin", 1)
        proc = hider(home, "in-flight", 1, forever=n == "writer")
        stack.callback(proc.wait)
        stack.callback(proc.kill)
        if n == "quiet":
            assert proc.stdout.readline() == b"ready\n"      # and writes no more
        launches[n] = Launch(["true"], {}, "/")
        stack.callback(launches[n].close)
        launches[n].pid = proc.pid
        d.watch(launches[n], n, home, run, d.measure(home, run))
    return launches


def test_below_the_floor_with_no_grower_the_fastest_writer_is_ended(tmp_path, monkeypatch):
    d = make(tmp_path, max_home_mb=4096, min_free_mb=64)
    with contextlib.ExitStack() as stack:
        launches = watch_quiet_and_writer(d, tmp_path, stack)
        monkeypatch.setattr(disk, "space", lambda p: Space(MIB, None))
        wait_for(lambda: launches["writer"].limit_hit() == "disk", "the writer ended", 10)
        assert launches["quiet"].limit_hit() is None


def test_space_going_where_no_home_shows_it_ends_the_fastest_writer(tmp_path, monkeypatch):
    d = make(tmp_path, max_home_mb=64, min_free_mb=1)
    with contextlib.ExitStack() as stack:
        launches = watch_quiet_and_writer(d, tmp_path, stack)
        free = [1 << 40]

        def vanishing(path):          # ~8 MiB gone per look (~160 MiB/s), no home grows
            free[0] -= 4 * MIB        # (two file systems are asked: the data dir, the homes)
            return Space(free[0], None)
        monkeypatch.setattr(disk, "space", vanishing)
        wait_for(lambda: launches["writer"].limit_hit() == "home_quota", "the writer ended", 10)
        assert launches["quiet"].limit_hit() is None


def test_a_slow_drift_of_free_space_ends_nobody(tmp_path, monkeypatch):
    d = make(tmp_path, max_home_mb=8, min_free_mb=1)
    home, run = tmp_path / "data" / "users" / "w", tmp_path / "data" / "runs" / "w"
    write(home / "x.bin", 1)
    proc = hider(home, "in-flight", 1, forever=True)
    launch = Launch(["true"], {}, "/")
    launch.pid = proc.pid
    free, looks = [1 << 40], []

    def drifting(path):           # 0.5 MiB per look, <= 10 MiB/s: under GROWTH_MB a second
        free[0] -= MIB // 2
        looks.append(1)
        return Space(free[0], None)
    monkeypatch.setattr(disk, "space", drifting)
    try:
        d.watch(launch, "w", home, run, d.measure(home, run))
        wait_for(lambda: len(looks) > 40, "40 looks (20 MiB: past its quota, but slowly)", 20)
        assert launch.limit_hit() is None
    finally:
        proc.kill()
        proc.wait()
        launch.close()


def test_files_deleted_before_the_next_walk_do_not_count_as_hidden_space(tmp_path, monkeypatch):
    """Free space rises at once when files go; the walk sees it up to a second later. That
    lag must not read as space gone where no home shows it (and end a fast writer)."""
    d = make(tmp_path, max_home_mb=32, min_free_mb=1)
    free = [1 << 40]
    monkeypatch.setattr(disk, "space", lambda p: Space(free[0], None))
    launches, procs = {}, {}
    for n in ("a", "c", "writer"):
        home, run = tmp_path / "data" / "users" / n, tmp_path / "data" / "runs" / n
        if n != "writer":
            write(home / "big.bin", 24)
        procs[n] = hider(home, "in-flight", 1, forever=n == "writer")
        launches[n] = Launch(["true"], {}, "/")
        launches[n].pid = procs[n].pid
        d.watch(launches[n], n, home, run, d.measure(home, run))
    try:
        wait_for(lambda: all(not w.ended for w in d.watcher._watched.values()) and
                 d.watcher._looked, "a first look", 5)
        for n in ("a", "c"):
            (tmp_path / "data" / "users" / n / "big.bin").unlink()
        free[0] += 48 * MIB                      # the file system has the room back at once
        deadline = time.monotonic() + 2.5        # two walks of every home
        while time.monotonic() < deadline:
            assert launches["writer"].limit_hit() is None
            time.sleep(0.05)
    finally:
        for n, proc in procs.items():
            proc.kill()
            proc.wait()
            launches[n].close()


def test_what_the_operator_is_told(tmp_path):
    d = make(tmp_path)
    assert "watched during turns" in d.describe() and "floor 0 MiB" in d.describe()
    assert d.problems("c.yaml") == []
    moved = Disk(Settings(quota="btrfs"), tmp_path / "data", tmp_path / "homes")
    write(tmp_path / "data" / "users" / "old" / "f", 0.01)
    found = moved.problems("c.yaml")
    assert any(p.startswith("c.yaml:hermes.sandbox.quota: btrfs, but") for p in found), found
    assert any("paths.homes_dir: the users' homes are still in" in p for p in found), found
    assert "not on btrfs" in disk_btrfs.quota_problem(tmp_path / "not" / "made" / "yet")
    moved.make_folder(tmp_path / "homes" / "users" / "x")       # no btrfs: the caller makes it
    assert not (tmp_path / "homes" / "users" / "x").exists()


def test_a_full_disk_is_recognised_whatever_raised_it():
    import sqlite3
    assert errors.storage_full(OSError(errno.ENOSPC, "full"))
    assert errors.storage_full(OSError(errno.EDQUOT, "quota"))
    e = sqlite3.OperationalError("disk I/O error")
    e.sqlite_errorname = "SQLITE_IOERR_SHMSIZE"
    assert errors.storage_full(e)
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert errors.storage_full(outer)
    assert not errors.storage_full(OSError(errno.EACCES, "no"))
    assert not errors.storage_full(ValueError("x"))


def test_a_write_that_meets_a_full_disk_is_507_not_500(stubbed_app, monkeypatch):
    from support.fixtures import API_KEY
    app = stubbed_app()
    store = app.extensions["hermes_service"].store

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(store, "create", full)
    res = app.test_client().post("/api/v1/sessions", json={"user_id": "u"},
                                 headers={"X-API-Key": API_KEY})
    assert res.status_code == 507 and res.get_json()["code"] == "storage_full", res.get_json()
    assert res.headers["Retry-After"] == "60"

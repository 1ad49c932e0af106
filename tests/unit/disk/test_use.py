"""What a home takes on disk (hermes_service/disk/use.py; docs/sandbox.md §Disk):
folders made unreadable still count (the service gives its own folders back ``u+rwx``,
through a pinned descriptor, never through a planted symlink), and files a process holds
open or mapped after their last name went count too — on the same file system only."""
from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hermes_service.disk.use import held_mb, home_size_mb, write_bytes

MIB = 1024 * 1024
NOBODY = 65534


def as_service(fn, path: Path) -> float:
    """``fn(path)`` as a service that is not root (forked, setuid to nobody when root)."""
    if os.geteuid() != 0:
        return fn(path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, repr(fn(path)).encode())
        finally:
            os._exit(0)
    os.close(w)
    out = os.read(r, 100)
    os.waitpid(pid, 0)
    return float(out)


def owned_tree(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)


@pytest.fixture
def reachable():
    """A folder the service that is not root can reach (pytest's tmp_path is root's 0700)."""
    where = Path(tempfile.mkdtemp(prefix="disk-use-"))
    os.chmod(where, 0o755)
    yield where
    for p in [where, *where.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            os.chmod(p, 0o700)
    shutil.rmtree(where)


def test_a_folder_made_unreadable_still_counts_and_a_planted_symlink_is_not_followed(reachable):
    home, outside = reachable / "home", reachable / "outside"
    (home / "a" / "b").mkdir(parents=True)
    (home / "a" / "b" / "big").write_bytes(b"\1" * (8 * MIB))
    outside.mkdir()
    (outside / "huge").write_bytes(b"\1" * (16 * MIB))
    (home / "link").symlink_to(outside)
    if os.geteuid() == 0:
        owned_tree(home)
    os.chmod(home / "a" / "b", 0)          # unreadable, unsearchable
    os.chmod(home / "a", 0o100)            # searchable, not readable
    try:
        size = as_service(home_size_mb, home)
    finally:
        os.chmod(home / "a", 0o700)
        os.chmod(home / "a" / "b", 0o700)
    assert 8 <= size < 9, size                          # not 0, not 24
    os.chmod(home, 0)                                   # the home itself
    try:
        assert 8 <= as_service(home_size_mb, home) < 9
    finally:
        os.chmod(home, 0o700)


def test_files_held_open_or_mapped_without_a_name_count_on_their_file_system_only(tmp_path):
    dev = os.stat(tmp_path).st_dev
    me = [os.getpid()]
    before = held_mb(me, {dev})
    tmpfile = os.open(tmp_path, os.O_TMPFILE | os.O_WRONLY, 0o600)
    os.write(tmpfile, b"\1" * (4 * MIB))
    unlinked = os.open(tmp_path / "gone", os.O_CREAT | os.O_RDWR, 0o600)
    os.write(unlinked, b"\1" * (2 * MIB))
    os.unlink(tmp_path / "gone")
    mapped_fd = os.open(tmp_path / "mapped", os.O_CREAT | os.O_RDWR, 0o600)
    os.write(mapped_fd, b"\1" * (3 * MIB))
    mapped = mmap.mmap(mapped_fd, 4096)                 # a window of it keeps it all
    os.unlink(tmp_path / "mapped")
    os.close(mapped_fd)
    named = open(tmp_path / "named", "wb")              # a named file: the walk counts it
    named.write(b"\1" * MIB)
    named.flush()
    try:
        assert 9 <= held_mb(me, {dev}) - before < 9.5
        assert held_mb(me, {dev + 1}) == held_mb(me, set()) == 0     # another device
        assert held_mb([2 ** 22 + 1], {dev}) == 0                  # no such process
    finally:
        mapped.close()
        named.close()
        os.close(tmpfile)
        os.close(unlinked)
    assert held_mb(me, {dev}) == before


def test_a_process_trees_writes_are_counted_while_it_lives():
    child = subprocess.Popen([sys.executable, "-c",
                              "import os, sys\nfor _ in range(64): os.write(1, b'x' * 65536)\n"
                              "sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        from support.fixtures import wait_for
        wait_for(lambda: write_bytes([child.pid]) >= 4 * MIB, "its writes counted", 10)
    finally:
        child.communicate(b"")
    assert write_bytes([child.pid]) == 0                        # gone: nothing


def test_files_held_by_many_processes_add_up_and_one_file_counts_once(tmp_path):
    dev = os.stat(tmp_path).st_dev
    before = held_mb([os.getpid()], {dev})           # (pytest's own capture files)
    shared = os.open(tmp_path / "shared", os.O_CREAT | os.O_RDWR, 0o600)
    os.write(shared, b"\1" * (2 * MIB))
    os.unlink(tmp_path / "shared")                  # the child inherits it: one file, 2 MiB
    code = ("import os, sys\nfd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)\n"
            "os.write(fd, b'x' * (3 << 20)); os.unlink(sys.argv[1])\n"
            "print('ready', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "own")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(shared,))
    try:
        assert child.stdout.readline() == b"ready\n"
        both = held_mb([os.getpid(), child.pid], {dev})
        assert 5 <= both - before < 5.5, both                  # 2 (once) + 3
    finally:
        child.communicate(b"")
        os.close(shared)

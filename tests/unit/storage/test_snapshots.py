"""hermes_service/storage/snapshots.py against a real temporary PostgreSQL
(tests/support/postgres.py): a home saved and restored whole; only changed chunks uploaded;
a ``state.db`` written by a live WAL writer restored consistent; hostile homes (a symlink out,
a FIFO, a sparse file over the quota, 100 000 files, a hardlink, a setuid bit) and forged
manifests (``../``, a file under a file, counts and hashes that do not add up) refused or left
out without a byte written outside the home; a rolled-back save leaves nothing; old manifests
pruned and unreferenced chunks collected."""
from __future__ import annotations

import hashlib
import os
import socket
import sqlite3
import stat
import threading
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from hermes_service.homefs import HomeTampered
from hermes_service.storage.snapshot_schema import SCHEMA
from hermes_service.storage.snapshots import (
    HomeSnapshots,
    SnapshotDamaged,
    SnapshotTooSlow,
    collect_garbage,
)
from support.postgres import PASSWORD_ENV

MIB = 1024 * 1024


@pytest.fixture
def db(pg_url):
    conn = psycopg.connect(pg_url, password=os.environ[PASSWORD_ENV])
    for sql in SCHEMA:
        conn.execute(sql)
    conn.commit()
    yield conn
    conn.close()


def make_db(path: Path, rows: int = 200, blob: int = 4000) -> None:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, content BLOB)")
    conn.executemany("INSERT INTO messages (content) VALUES (?)",
                     [(os.urandom(blob),) for _ in range(rows)])
    conn.commit()
    conn.close()


def make_home(root: Path, name: str = "alice") -> Path:
    home = root / "users" / name
    (home / ".hermes" / "skills" / "deep").mkdir(parents=True)
    (home / "empty").mkdir()
    (home / ".hermes" / "config.yaml").write_text("model: x\n")
    (home / ".hermes" / "skills" / "deep" / "s.md").write_bytes(os.urandom(64 * 1024))
    (home / "notes.txt").write_bytes(os.urandom(64 * 1024 + 1))
    (home / "zero").write_bytes(b"")
    run = home / "run.sh"
    run.write_text("#!/bin/sh\n")
    run.chmod(0o750)
    make_db(home / ".hermes" / "state.db")
    return home


def tree(home: Path) -> dict[str, tuple]:
    """path → (kind, permission bits, sha256 of the content) of everything under ``home``."""
    out = {}
    for dirpath, dirs, files in os.walk(home):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(home))
            st = p.lstat()
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", stat.S_IMODE(st.st_mode),
                            hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = ("other",)
    return out


def rows(db_path: Path) -> list[tuple]:
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return conn.execute("SELECT id, content FROM messages ORDER BY id").fetchall()
    finally:
        conn.close()


def save(db, snaps: HomeSnapshots, home: Path, user: str = "alice"):
    info = snaps.save(db, user, home)
    db.commit()
    return info


def restore_elsewhere(db, tmp_path: Path, user: str = "alice", **kw) -> Path:
    """Restore the user's home on "another node": a fresh users folder."""
    other = tmp_path / "node2" / "users"
    other.mkdir(parents=True, exist_ok=True)
    home = other / user
    info = HomeSnapshots(64 * MIB, **kw).restore(db, user, home)
    db.commit()
    assert info is not None
    return home


def test_a_home_round_trips(db, tmp_path):
    home = make_home(tmp_path)
    snaps = HomeSnapshots(64 * MIB)
    info = save(db, snaps, home)
    assert info.seq == 1 and info.files == 6 and info.skipped == {}
    assert info.chunks_uploaded == info.chunks_total > 0
    before = tree(home)
    restored = restore_elsewhere(db, tmp_path)
    after = tree(restored)
    # the state.db's WAL and shared memory are folded into the copy, never stored as files
    for side in (".hermes/state.db-wal", ".hermes/state.db-shm"):
        before.pop(side, None)
    db_entry = ".hermes/state.db"
    assert {k: v for k, v in after.items() if k != db_entry} == \
        {k: v for k, v in before.items() if k != db_entry}
    assert rows(restored / db_entry) == rows(home / db_entry)
    assert after["run.sh"][1] == 0o750
    assert not list(restored.parent.glob(".alice.restore-*"))


def test_only_changed_chunks_are_uploaded_after_a_small_change(db, tmp_path):
    home = make_home(tmp_path)
    make_db(home / ".hermes" / "big.db", rows=250, blob=4000)      # ~1 MB, 16 chunks
    snaps = HomeSnapshots(64 * MIB)
    first = save(db, snaps, home)
    conn = sqlite3.connect(home / ".hermes" / "big.db")
    conn.execute("UPDATE messages SET content = ? WHERE id = 100", (os.urandom(4000),))
    conn.commit()
    conn.close()
    (home / "zero").write_bytes(b"changed")
    second = save(db, snaps, home)
    assert second.seq == 2 and second.chunks_total >= first.chunks_total
    assert 1 <= second.chunks_uploaded <= 4, second
    # a node that never saw this home (no remembered hashes) uploads no more than that
    third = save(db, HomeSnapshots(64 * MIB), home)
    assert third.chunks_uploaded == 0
    assert rows(restore_elsewhere(db, tmp_path) / ".hermes" / "big.db") == \
        rows(home / ".hermes" / "big.db")


def test_a_state_db_written_by_a_live_wal_writer_restores_consistent(db, tmp_path):
    """A writer keeps the file open and commits transfers that keep the sum at 1000 (and a
    row per commit) while the snapshot copies it: the copy is one commit's state."""
    home = make_home(tmp_path)
    path = home / ".hermes" / "state.db"
    setup = sqlite3.connect(path)
    setup.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, bal INTEGER)")
    setup.executemany("INSERT INTO acct VALUES (?, ?)", [(i, 100) for i in range(10)])
    setup.commit()
    setup.close()
    stop, commits = threading.Event(), []

    def writer():
        conn = sqlite3.connect(path, isolation_level=None)
        n = 0
        while not stop.is_set():
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE acct SET bal = bal - 7 WHERE id = ?", (n % 10,))
            conn.execute("UPDATE acct SET bal = bal + 7 WHERE id = ?", ((n + 3) % 10,))
            conn.execute("INSERT INTO messages (content) VALUES (?)", (os.urandom(3000),))
            conn.execute("COMMIT")
            n += 1
            commits.append(n)
        conn.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        while len(commits) < 20:            # the writer is under way
            stop.wait(0.01)
        save(db, HomeSnapshots(64 * MIB), home)
        during = len(commits)
    finally:
        stop.set()
        thread.join()
    restored = restore_elsewhere(db, tmp_path) / ".hermes" / "state.db"
    conn = sqlite3.connect(restored)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert conn.execute("SELECT sum(bal) FROM acct").fetchone() == (1000,)
    saved = conn.execute("SELECT count(*) FROM messages").fetchone()[0] - 200
    assert 20 <= saved <= during
    conn.close()


def test_a_hostile_home_keeps_only_its_folders_and_regular_files(db, tmp_path):
    home = make_home(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    (home / "link-out").symlink_to(secret)
    (home / "dir-out").symlink_to(tmp_path)
    os.mkfifo(home / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(home / "sock"))
    os.link(home / "notes.txt", home / "hard")
    (home / "suid").write_text("x")
    (home / "suid").chmod(0o4755)
    (home / "sticky").mkdir()
    (home / "sticky").chmod(0o1777)
    with open(home / "sparse", "wb") as f:           # 10 GB that takes no disk
        f.truncate(10 * 1024 * MIB)
    info = save(db, HomeSnapshots(64 * MIB, seconds=60), home)
    sock.close()
    assert info.skipped == {"symlink": 2, "fifo": 1, "socket": 1, "hardlink": 2,
                            "over_quota": 1}
    restored = tree(restore_elsewhere(db, tmp_path))
    for gone in ("link-out", "dir-out", "fifo", "sock", "hard", "notes.txt", "sparse"):
        assert gone not in restored
    assert restored["suid"][1] == 0o755 and restored["sticky"] == ("dir", 0o777)


def test_a_home_of_100k_files_is_cut_at_the_entry_cap(db, tmp_path):
    home = tmp_path / "users" / "alice"
    many = home / "many"
    many.mkdir(parents=True)
    for i in range(100_000):
        os.close(os.open(many / str(i), os.O_CREAT | os.O_WRONLY, 0o600))
    info = save(db, HomeSnapshots(64 * MIB, max_entries=5_000), home)
    assert info.files == 4_999 and info.skipped == {"over_entry_cap": 1}
    assert len(list((restore_elsewhere(db, tmp_path, max_entries=5_000) / "many")
                    .iterdir())) == 4_999


def test_a_symlinked_home_or_a_planted_wal_is_refused(db, tmp_path):
    home = make_home(tmp_path)
    link = tmp_path / "users" / "bob"
    link.symlink_to(home)
    snaps = HomeSnapshots(64 * MIB)
    with pytest.raises(HomeTampered):
        snaps.save(db, "bob", link)
    db.rollback()
    wal = home / ".hermes" / "state.db-wal"
    wal.unlink(missing_ok=True)
    wal.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(HomeTampered) as err:
        snaps.save(db, "alice", home)
    db.rollback()
    assert err.value.code == "home_tampered" and "state.db-wal" in err.value.detail
    assert not (tmp_path / "elsewhere").exists()


def test_a_save_past_its_time_is_refused(db, tmp_path):
    with pytest.raises(SnapshotTooSlow) as err:
        HomeSnapshots(64 * MIB, seconds=0).save(db, "alice", make_home(tmp_path))
    db.rollback()
    assert err.value.status == 503


def forge(db, entries, chunks, user="mallory", data=()):
    for h, d in data:
        db.execute("INSERT INTO home_chunks (hash, data) VALUES (%b, %b) "
                   "ON CONFLICT DO NOTHING", (h, d))
    db.execute("INSERT INTO home_manifests (user_id, seq, files, bytes, entries, chunks) "
               "VALUES (%s, 1, 0, 0, %s, %b)", (user, Jsonb(entries), chunks))
    db.commit()


DATA = b"evil"
HASH = hashlib.sha256(DATA).digest()


def file_entry(path, size=4, chunks=1, mode=0o644):
    return {"path": path, "kind": "file", "mode": mode, "size": size, "chunks": chunks}


@pytest.mark.parametrize("entries, chunks", [
    ([file_entry("../evil")], [HASH]),
    ([file_entry("/abs")], [HASH]),
    ([{"path": "a", "kind": "dir", "mode": 0o700}, file_entry("a/../../evil")], [HASH]),
    ([file_entry("a"), file_entry("a/b")], [HASH, HASH]),            # a file under a file
    ([file_entry("a"), file_entry("a")], [HASH, HASH]),              # twice
    ([file_entry("x/y")], [HASH]),                                   # folder never listed
    ([file_entry("a", chunks=2)], [HASH]),                           # counts do not add up
    ([file_entry("a", size=10 ** 12, chunks=1)], [HASH]),            # over the quota
    ([file_entry("a")], [b"short"]),
    ([file_entry("./a")], [HASH]),
    ([{"path": "a", "kind": "fifo", "mode": 0o644}], []),
    ([dict(file_entry("a"), extra=1)], [HASH]),
    ([file_entry("a", mode=True)], [HASH]),
    ({"not": "a list"}, []),
    ([file_entry("a")], [hashlib.sha256(b"other").digest()]),        # chunk missing
    ([file_entry("a", size=3)], [HASH]),                             # length does not match
])
def test_a_forged_manifest_writes_nothing(db, tmp_path, entries, chunks):
    forge(db, entries, chunks, data=[(HASH, DATA)])
    users = tmp_path / "users"
    home = users / "mallory"
    home.mkdir(parents=True)
    (home / "keep").write_text("kept")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(SnapshotDamaged) as err:
        HomeSnapshots(64 * MIB).restore(db, "mallory", home)
    assert err.value.code == "home_snapshot_damaged" and err.value.status == 503
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert (home / "keep").read_text() == "kept"


def test_a_chunk_not_matching_its_hash_is_refused(db, tmp_path):
    forge(db, [file_entry("a")], [HASH], data=[(HASH, b"eviL")])
    home = tmp_path / "users" / "mallory"
    home.parent.mkdir()
    with pytest.raises(SnapshotDamaged, match="does not match"):
        HomeSnapshots(64 * MIB).restore(db, "mallory", home)
    assert not home.exists() and os.listdir(tmp_path / "users") == []


def test_a_rolled_back_save_leaves_no_manifest(db, tmp_path):
    home = make_home(tmp_path)
    snaps = HomeSnapshots(64 * MIB)
    snaps.save(db, "alice", home)
    db.rollback()
    assert db.execute("SELECT count(*) FROM home_manifests").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM home_chunks").fetchone() == (0,)
    assert snaps.restore(db, "alice", tmp_path / "users" / "nobody") is None
    assert save(db, snaps, home).seq == 1        # the remembered hashes were not trusted
    assert restore_elsewhere(db, tmp_path).joinpath("notes.txt").read_bytes() == \
        (home / "notes.txt").read_bytes()


def test_restore_replaces_the_home_whole(db, tmp_path):
    home = make_home(tmp_path)
    snaps = HomeSnapshots(64 * MIB)
    save(db, snaps, home)
    expected = tree(home)
    (home / "later").write_text("not in the snapshot")
    (home / "notes.txt").write_text("changed")
    snaps.restore(db, "alice", home)
    db.commit()
    assert "later" not in tree(home) and tree(home)["notes.txt"] == expected["notes.txt"]
    assert sorted(os.listdir(home.parent)) == ["alice"]


def test_old_manifests_are_pruned_and_unreferenced_chunks_collected(db, tmp_path):
    home = make_home(tmp_path)
    snaps = HomeSnapshots(64 * MIB, keep=2)
    for _ in range(4):
        (home / "notes.txt").write_bytes(os.urandom(100_000))
        save(db, snaps, home)
    assert [r[0] for r in db.execute("SELECT seq FROM home_manifests ORDER BY seq")] == [3, 4]
    removed = collect_garbage(db)
    db.commit()
    assert removed >= 4                      # the two dropped versions of notes.txt, 2 each
    referenced = db.execute("SELECT count(DISTINCT h) FROM home_manifests, "
                            "unnest(chunks) h").fetchone()[0]
    assert db.execute("SELECT count(*) FROM home_chunks").fetchone() == (referenced,)
    assert restore_elsewhere(db, tmp_path).joinpath("notes.txt").read_bytes() == \
        (home / "notes.txt").read_bytes()


def test_restore_builds_in_the_folder_make_folder_makes_and_clears_a_killed_one(db, tmp_path):
    home = make_home(tmp_path)
    save(db, HomeSnapshots(64 * MIB), home)
    stale = home.parent / ".alice.restore-0123456789ab"
    (stale / "half").mkdir(parents=True)
    made = []

    def make_folder(path: Path) -> None:
        made.append(path)
        (path / ".hermes").mkdir(parents=True, mode=0o700)    # as the disk makes a home

    HomeSnapshots(64 * MIB, make_folder=make_folder).restore(db, "alice", home)
    db.commit()
    assert len(made) == 1 and made[0].parent == home.parent
    assert made[0].name.startswith(".alice.restore-") and not made[0].exists()
    assert sorted(os.listdir(home.parent)) == ["alice"]
    assert (home / ".hermes" / "state.db").is_file()


def test_a_damaged_database_is_left_out_but_a_damaged_state_db_fails_the_save(db, tmp_path):
    home = make_home(tmp_path)
    damaged = b"SQLite format 3\x00" + b"\xff" * 5000
    (home / ".hermes" / "kanban.db").write_bytes(damaged)
    info = save(db, HomeSnapshots(64 * MIB), home)
    assert info.skipped == {"sqlite_unreadable": 1}
    for side in ("-wal", "-shm"):
        (home / ".hermes" / f"state.db{side}").unlink(missing_ok=True)
    (home / ".hermes" / "state.db").write_bytes(damaged)
    with pytest.raises(HomeTampered) as err:
        HomeSnapshots(64 * MIB).save(db, "alice", home)
    db.rollback()
    assert "state.db" in err.value.detail
    assert db.execute("SELECT max(seq) FROM home_manifests").fetchone() == (1,)


def test_garbage_collection_waits_for_a_save_relying_on_an_unreferenced_chunk(db, pg_url,
                                                                               tmp_path):
    """A save that found a chunk no manifest names yet (and so did not upload it) holds the
    collection off until it commits; then the chunk is named and stays."""
    home = make_home(tmp_path)
    save(db, HomeSnapshots(64 * MIB), home)
    db.execute("DELETE FROM home_manifests")          # every chunk unreferenced, none gone
    db.commit()
    info = HomeSnapshots(64 * MIB).save(db, "alice", home)      # open, not committed
    assert info.chunks_uploaded == 0
    other = psycopg.connect(pg_url, password=os.environ[PASSWORD_ENV])
    try:
        other.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            collect_garbage(other)
        other.rollback()
        db.commit()
        assert collect_garbage(other) == 0
        other.commit()
    finally:
        other.close()
    assert rows(restore_elsewhere(db, tmp_path) / ".hermes" / "state.db") == \
        rows(home / ".hermes" / "state.db")

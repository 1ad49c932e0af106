"""The service never follows what a user's agent planted in its home or run folder
(hermes_service/homefs.py): for every entry the service reads or writes, a symlink to a file
outside, a symlinked folder, a hardlink, a FIFO, a socket or a directory in its place is
repaired or refused (409 ``home_tampered``), and the "victim" outside is never changed or read."""
import concurrent.futures
import json
import os
import socket
import sqlite3
import time
from datetime import UTC, datetime

import pytest

from hermes_service import homefs
from hermes_service.files import atomic_write
from hermes_service.homes import hermes_state
from hermes_service.homes.users import MARKER, UserHomes
from hermes_service.runner import RunFiles
from hermes_service.runner.cli import _read_marker
from support.hermes_record import SCHEMA, record_turn

SECRET = "VICTIM-SECRET-do-not-read"
TIMEOUT = 10        # a FIFO must never block: every call that meets one is bounded by this


def bounded(fn, *args, **kw):
    """``fn(*args)`` in a thread, failing the test if it does not return within TIMEOUT."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args, **kw).result(timeout=TIMEOUT)
    finally:
        pool.shutdown(wait=False)


@pytest.fixture
def victim(tmp_path):
    """A file outside every home: its content must stay and must never be returned."""
    path = tmp_path / "victim" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    yield path
    assert path.read_text() == SECRET and path.is_file() and not path.is_symlink()


def plant(path, how, victim):
    """Put ``how`` at ``path`` (removing what is there): symlink | hardlink | fifo | dir | socket."""
    if path.is_dir() and not path.is_symlink():
        import shutil
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "symlink":
        path.symlink_to(victim)
    elif how == "hardlink":
        os.link(victim, path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        path.mkdir()
        (path / "inside").write_text("x")
    elif how == "socket":
        s, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        os.chdir(path.parent)                   # AF_UNIX names are short: bind relative
        try:
            s.bind(path.name)
        finally:
            os.chdir(cwd)
            s.close()


KINDS = ["symlink", "hardlink", "fifo", "dir", "socket"]


# -- the primitives ---------------------------------------------------------------------

@pytest.mark.parametrize("how", KINDS)
def test_read_file_refuses_anything_but_a_plain_file_and_never_blocks(tmp_path, victim, how):
    folder = tmp_path / "home"
    plant(folder / "f", how, victim)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(homefs.HomeTampered) as err:
            bounded(homefs.read_file, fd, "f")
    finally:
        os.close(fd)
    assert err.value.status == 409 and err.value.code == "home_tampered"
    assert SECRET not in err.value.detail


def test_read_file_is_bounded(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 100)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert homefs.read_file(fd, "big", limit=100) == b"x" * 100
        with pytest.raises(homefs.HomeTampered, match="larger than 99"):
            homefs.read_file(fd, "big", limit=99)
        assert homefs.read_file(fd, "missing") is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", KINDS)
def test_a_write_replaces_the_planted_entry_never_writes_through_it(tmp_path, victim, how):
    folder = tmp_path / "home"
    plant(folder / "f", how, victim)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bounded(homefs.write_file, fd, "f", "mine")
    finally:
        os.close(fd)
    st = os.lstat(folder / "f")
    assert homefs.plain(st) and (folder / "f").read_text() == "mine"
    assert sorted(p.name for p in folder.iterdir()) == ["f"]       # no temp file left


def test_atomic_write_with_dir_fd_takes_a_bare_name_only(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(ValueError):
            atomic_write("a/b", "x", dir_fd=fd)
        atomic_write("ok", "x", dir_fd=fd)
    finally:
        os.close(fd)
    assert (tmp_path / "ok").read_text() == "x" and oct((tmp_path / "ok").stat().st_mode)[-3:] == "600"


def test_open_dirs_refuses_or_repairs_a_symlinked_folder(tmp_path, victim):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "d").symlink_to(victim.parent)
    with pytest.raises(homefs.HomeTampered, match="is a symlink"):
        homefs.open_dirs(tmp_path / "base", "d")
    fd = homefs.open_dirs(tmp_path / "base", "d", create=True, repair=True)
    os.close(fd)
    assert (tmp_path / "base" / "d").is_dir() and not (tmp_path / "base" / "d").is_symlink()


# -- the user's home: template files, config.yaml, the marker ---------------------------

@pytest.fixture
def homes(make_config):
    cfg = make_config()
    return UserHomes(cfg.paths, cfg.hermes)


def _refreshed(home):
    """The service's files are in place and plain."""
    cfg = home.hermes_home / "config.yaml"
    assert homefs.plain(os.lstat(cfg)) and "provider" in cfg.read_text()
    marker = home.root / MARKER
    assert homefs.plain(os.lstat(marker)) and "fingerprint" in json.loads(marker.read_text())
    for rel in ("plugins/mnote/plugin.yaml", "plugins/hermes_service/__init__.py"):
        assert homefs.plain(os.lstat(home.hermes_home / rel))
        assert not (home.hermes_home / rel).parent.is_symlink()


@pytest.mark.parametrize("entry", [".hermes/config.yaml", MARKER])
@pytest.mark.parametrize("how", KINDS)
def test_a_planted_config_or_marker_is_replaced_on_the_next_turn(homes, victim, entry, how):
    home = homes.ensure("u1")
    plant(home.root / entry, how, victim)
    bounded(homes.ensure, "u1")
    _refreshed(home)


@pytest.mark.parametrize("entry", ["plugins/mnote", "plugins", "plugins/mnote/plugin.yaml",
                                   "plugins/hermes_service/__init__.py"])
@pytest.mark.parametrize("how", KINDS)
def test_planted_plugin_folders_and_files_are_replaced_at_a_refresh(homes, victim, entry, how):
    home = homes.ensure("u1")
    target = home.hermes_home / entry
    if how == "symlink" and "." not in entry.rsplit("/", 1)[-1]:     # a folder: to a folder
        plant(target, "dir", victim)
        import shutil
        shutil.rmtree(target)
        target.symlink_to(victim.parent)
    else:
        plant(target, how, victim)
    (home.root / MARKER).unlink()              # a template change: the home is refreshed
    bounded(homes.ensure, "u1")
    _refreshed(home)
    assert sorted(p.name for p in victim.parent.iterdir()) == ["secret.txt"]


@pytest.mark.parametrize("how", ["symlink", "fifo", "dir", "socket", "hardlink"])
def test_a_planted_hermes_folder_is_replaced(homes, victim, how):
    home = homes.ensure("u1")
    import shutil
    shutil.rmtree(home.hermes_home)
    if how == "symlink":
        home.hermes_home.symlink_to(victim.parent)
    else:
        plant(home.hermes_home, how, victim)     # "dir": an empty folder, filled again
    bounded(homes.ensure, "u1")
    assert home.hermes_home.is_dir() and not home.hermes_home.is_symlink()
    _refreshed(home)
    assert sorted(p.name for p in victim.parent.iterdir()) == ["secret.txt"]


def test_a_home_folder_that_is_a_symlink_is_refused(homes, victim):
    root = homes.path("u1").root
    root.symlink_to(victim.parent)
    with pytest.raises(homefs.HomeTampered) as err:
        homes.ensure("u1")
    assert err.value.status == 409 and "symlink" in err.value.detail
    assert sorted(p.name for p in victim.parent.iterdir()) == ["secret.txt"]


@pytest.mark.parametrize("name", ["state.db", "state.db-wal", "state.db-shm", "state.db-journal"])
@pytest.mark.parametrize("how", KINDS)
def test_planted_state_files_are_removed_before_the_turn(homes, victim, name, how):
    home = homes.ensure("u1")
    record_turn(home.hermes_home, "s1", "hi", answer="hello")
    if name == "state.db":
        (home.hermes_home / "state.db").unlink()
    plant(home.hermes_home / name, how, victim)
    bounded(homes.ensure, "u1")                  # the fast path sees it and repairs
    assert not os.path.lexists(home.hermes_home / name)


def test_the_fast_path_writes_nothing(homes, monkeypatch):
    home = homes.ensure("u1")
    calls = []
    monkeypatch.setattr(homefs, "write_file", lambda *a, **k: calls.append(a))
    for _ in range(3):
        assert homes.ensure("u1") == home
    assert calls == []


# -- state.db ---------------------------------------------------------------------------

def victim_db(path):
    """Another user's state.db: a session whose messages must never reach this user."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        db.execute("INSERT INTO sessions (id, source, started_at) VALUES ('s1', 'tool', 1)")
        db.execute("INSERT INTO messages (session_id, role, content, timestamp) "
                   "VALUES ('s1', 'user', ?, 1)", (SECRET,))
        db.commit()
    finally:
        db.close()
    return path


def _all_reads(home):
    return [lambda: hermes_state.transcript(home, "s1"),
            lambda: hermes_state.session_summary(home, "s1"),
            lambda: hermes_state.turn_record(home, "s1", SECRET),
            lambda: hermes_state.lineage_ids(home, "s1"),
            lambda: hermes_state.rewind_unanswered(home, "s1", SECRET),
            lambda: hermes_state.rewind_orphan(home, "s1")]


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize("case", ["db-symlink", "db-hardlink", "dir-symlink", "db-fifo", "db-dir",
                                  "db-socket", "wal-symlink", "shm-symlink", "journal-symlink",
                                  "wal-hardlink", "shm-fifo", "wal-dir"])
def test_state_db_is_never_opened_through_what_the_agent_planted(tmp_path, case):
    users = tmp_path / "users"
    home = users / "a" / ".hermes"
    other = victim_db(tmp_path / "users" / "b" / ".hermes" / "state.db")
    what, how = case.split("-")
    if what == "dir":
        home.parent.mkdir(parents=True)
        home.symlink_to(other.parent)
    else:
        record_turn(home, "s1", "mine", answer="my answer")
        suffix = {"db": "", "wal": "-wal", "shm": "-shm", "journal": "-journal"}[what]
        target = other if what == "db" else other.parent / "loose"
        if what != "db":
            target.write_bytes(b"VICTIM")
        entry = home / ("state.db" + suffix)
        if entry.exists():
            entry.unlink()
        plant(entry, how, target)
    before = _snapshot(other.parent)
    for read in _all_reads(home):
        with pytest.raises(homefs.HomeTampered) as err:
            bounded(read)
        assert err.value.code == "home_tampered" and SECRET not in err.value.detail
    assert _snapshot(other.parent) == before
    with sqlite3.connect(other) as db:
        assert db.execute("SELECT active FROM messages").fetchall() == [(1,)]


def test_state_db_reads_and_the_rewind_still_work(tmp_path):
    home = tmp_path / "users" / "a" / ".hermes"
    record_turn(home, "s1", "q1", answer="a1")
    record_turn(home, "s1", "q2")
    assert [m["content"] for m in hermes_state.transcript(home, "s1")] == ["q1", "a1", "q2"]
    assert hermes_state.rewind_unanswered(home, "s1", "q2") is True
    assert [m["content"] for m in hermes_state.transcript(home, "s1")] == ["q1", "a1"]
    assert hermes_state.transcript(tmp_path / "users" / "nobody" / ".hermes", "s1") == []


def test_a_state_db_without_hermes_tables_or_not_sqlite_reads_empty_or_is_refused(tmp_path):
    home = tmp_path / "users" / "a" / ".hermes"
    home.mkdir(parents=True)
    (home / "state.db").write_bytes(b"")
    assert hermes_state.transcript(home, "s1") == []
    (home / "state.db").write_bytes(b"junk" * 1000)
    with pytest.raises(homefs.HomeTampered, match="not a SQLite database"):
        hermes_state.transcript(home, "s1")


def test_a_state_db_swapped_while_it_is_opened_is_refused(tmp_path, monkeypatch):
    """The swap lands between the checks and SQLite's open (simulated at sqlite3.connect):
    the post-open check sees the name resolved elsewhere, or a new inode, and refuses."""
    home = tmp_path / "users" / "a" / ".hermes"
    record_turn(home, "s1", "mine", answer="my answer")
    other = victim_db(tmp_path / "users" / "b" / ".hermes" / "state.db")
    real_connect = sqlite3.connect
    names = sorted(p.name for p in other.parent.iterdir())

    def swapping(database, **kw):
        (home / "state.db").rename(home / "kept.db")
        (home / "state.db").symlink_to(other)
        try:
            return real_connect(database, **kw)
        finally:
            (home / "state.db").unlink()
            (home / "kept.db").rename(home / "state.db")
            os.utime(home / "state.db")
    monkeypatch.setattr(hermes_state.sqlite3, "connect", swapping)
    with pytest.raises(homefs.HomeTampered, match="replaced while it was opened"):
        hermes_state.transcript(home, "s1")

    def swap_folder(database, **kw):
        home.rename(home.parent / "kept")
        home.symlink_to(other.parent)
        return real_connect(database, **kw)
    monkeypatch.setattr(hermes_state.sqlite3, "connect", swap_folder)
    with pytest.raises(homefs.HomeTampered):
        hermes_state.transcript(home, "s1")
    # refused before the first read: SQLite made no -wal/-shm next to the other database
    assert sorted(p.name for p in other.parent.iterdir()) == names


# -- run files ---------------------------------------------------------------------------

@pytest.fixture
def runs(tmp_path):
    return RunFiles(tmp_path / "runs")


@pytest.mark.parametrize("how", KINDS)
def test_a_planted_turn_marker_is_not_read_and_is_removed(runs, victim, how):
    marker = runs.user_dir("u1") / "cli-1.turn"
    plant(marker, how, victim)
    assert bounded(_read_marker, marker, runs) is None
    runs.remove(marker)
    assert not os.path.lexists(marker)
    marker.write_text("sess_1\n")
    assert _read_marker(marker, runs) == "sess_1"


@pytest.mark.parametrize("how", ["symlink", "fifo", "socket"])
def test_a_run_folder_that_is_not_a_folder_is_made_again(runs, victim, how):
    runs.root.mkdir(parents=True)
    if how == "symlink":
        (runs.root / "u1").symlink_to(victim.parent)
    else:
        plant(runs.root / "u1", how, victim)
    path = bounded(runs.user_dir, "u1")
    assert path.is_dir() and not path.is_symlink()
    (path / "x.json").write_text("{}")
    assert sorted(p.name for p in victim.parent.iterdir()) == ["secret.txt"]


def test_the_sweep_follows_nothing(runs, victim, tmp_path):
    old = time.time() - 7200
    d = runs.user_dir("u1")
    for name, how in [("a.json", "symlink"), ("b.turn", "fifo"), ("c", "dir"), ("d", "hardlink")]:
        plant(d / name, how, victim)
        os.utime(d / name, (old, old), follow_symlinks=False)
    (d / "fresh.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "old.json").write_text("keep")
    os.utime(outside / "old.json", (old, old))
    (runs.root / "u2").symlink_to(outside)                       # a symlinked user folder
    assert bounded(runs.sweep, 3600) == 4
    assert sorted(p.name for p in d.iterdir()) == ["fresh.json"]
    assert (outside / "old.json").read_text() == "keep"


# -- gc ----------------------------------------------------------------------------------

def test_gc_purge_over_a_tampered_home_reports_it_and_touches_nothing_outside(make_config,
                                                                             tmp_path):
    from hermes_service.retention import collect
    from hermes_service.services import build_services
    svc = build_services(make_config())
    old = datetime.fromtimestamp(time.time() - 40 * 86400, UTC).isoformat()
    for sid, user in (("old-a", "alice"), ("old-b", "bob")):
        svc.store.create({"session_id": sid, "user_id": user, "created_at": old,
                          "updated_at": old, "status": "active", "kind": "v1",
                          "hermes_session_id": "s1" if user == "alice" else None})
    other = victim_db(tmp_path / "elsewhere" / "state.db")
    before = other.read_bytes()
    home = svc.homes.ensure("alice").hermes_home
    (home / "state.db").symlink_to(other)
    report = collect(svc, older_than=30 * 86400, purge_transcripts=True)
    assert len(report.problems) == 1 and "home_tampered" not in report.problems[0]
    assert "old-a" in report.problems[0] and "not a plain file" in report.problems[0]
    assert svc.store.get("old-a") is not None and svc.store.get("old-b") is None
    assert other.read_bytes() == before


# -- a state.db whose schema the user's agent wrote: no query of the service runs for ever


def _hostile_home(tmp_path):
    hermes_home = tmp_path / "users" / "mallory" / ".hermes"
    record_turn(hermes_home, "s1", "hello", answer="hi")
    return hermes_home


def test_a_view_in_place_of_hermess_table_is_refused_at_once(tmp_path):
    hermes_home = _hostile_home(tmp_path)
    with sqlite3.connect(hermes_home / "state.db") as db:
        db.executescript("""
            ALTER TABLE messages RENAME TO messages_real;
            CREATE VIEW messages AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n)
              SELECT m.* FROM messages_real m, n;""")
    started = time.monotonic()
    with pytest.raises(homefs.HomeTampered, match="view"):
        hermes_state.turn_record(hermes_home, "s1", "hello")
    assert time.monotonic() - started < 5


def test_a_trigger_that_never_ends_is_refused_before_the_write(tmp_path, monkeypatch):
    """A rewind (UPDATE of messages) would fire the agent's trigger: the service does not
    write through a trigger that is not Hermes's (409 ``home_tampered``), so nothing runs,
    let alone for ever (homes/state_db.py; a statement is also cut off at its deadline)."""
    from hermes_service.homes import state_db
    monkeypatch.setattr(state_db, "STATE_DB_SECONDS", 1.0)
    hermes_home = _hostile_home(tmp_path)
    record_turn(hermes_home, "s1", "unanswered")
    with sqlite3.connect(hermes_home / "state.db") as db:
        db.executescript("""
            CREATE TRIGGER forever AFTER UPDATE ON messages BEGIN
              SELECT count(*) FROM (WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1
                FROM n) SELECT i FROM n);
            END;""")
    started = time.monotonic()
    with pytest.raises(homefs.HomeTampered, match="trigger forever is not one of Hermes's"):
        hermes_state.rewind_unanswered(hermes_home, "s1", "unanswered")
    assert time.monotonic() - started < 1

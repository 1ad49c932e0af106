"""Retention and cleanup (docs/data-and-durability.md): ``main.py gc`` and the service's periodic pass remove
exactly what is stale, keep what a running turn uses, and ``--dry-run`` removes nothing."""
import os
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime

import pytest
import yaml

from hermes_service.config import ConfigError
from hermes_service.retention import RetentionJob, collect
from hermes_service.services import build_services
from support.fixtures import API_KEY, ROOT, base_config

DAY = 86400.0
HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from filelock import FileLock
with FileLock({path!r}):
    print("held", flush=True)
    sys.stdin.read()
"""


def iso(t: float, spec: str = "microseconds") -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec=spec)


def rec(sid, user, used: float, **extra):
    return {"session_id": sid, "user_id": user, "created_at": iso(used), "updated_at": iso(used),
            "status": "active", "kind": "v1", "hermes_session_id": None, **extra}


def snapshot(data_dir):
    """Every path under data/ with its content (files), target (links) or nothing (folders),
    plus the page store's idempotency rows."""
    out = {}
    for path in sorted(data_dir.rglob("*")):
        key = str(path.relative_to(data_dir))
        if path.name.endswith((".db-wal", ".db-shm", ".db-journal")):
            continue     # SQLite's side files come and go as connections close elsewhere
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file() and not path.name.endswith(".db"):   # databases: rows below
            out[key] = path.read_bytes()
        else:
            out[key] = None
    with sqlite3.connect(data_dir / "mnote.db") as con:
        out["idempotency"] = con.execute("SELECT * FROM idempotency ORDER BY idem_key").fetchall()
    with sqlite3.connect(data_dir / "idempotency.db") as con:
        out["idempotency keys"] = con.execute("SELECT * FROM requests ORDER BY idem_key").fetchall()
    return out


@pytest.fixture
def stale_world(make_config):
    """A data dir with one of each kind of stale thing, and one of each kind of live thing."""
    svc = build_services(make_config())
    store, data, now = svc.store, svc.config.data_dir, time.time()
    store.create(rec("stale-a", "alice", now - 40 * DAY))
    store.create(rec("stale-b", "bob", now - 31 * DAY))
    store.create(rec("fresh", "alice", now - 29 * DAY))
    store.create({"session_id": "undated", "user_id": "alice", "created_at": "x"})
    locks = data / "locks"
    locks.mkdir(exist_ok=True)
    for name in ("session-gone.lock", "session-fresh.lock", "session-stale-b.lock",
                 "home-alice.lock", "session-..bad.lock"):
        (locks / name).touch()
    for sid, age in (("dangling-old", 7200), ("dangling-young", 60)):
        link = store.link_path(sid)
        link.parent.mkdir(exist_ok=True)
        os.symlink("../../alice", link)
        os.utime(link, (now - age, now - age), follow_symlinks=False)
    (data / "sessions" / "bob" / ".sessions.killed.tmp").write_text("{half")
    with sqlite3.connect(svc.extensions["mnote"].tools.store.path) as con:
        for key, age in (("k-old", 2 * DAY), ("k-new", 3600)):
            con.execute("INSERT INTO idempotency VALUES (?,?,?,?,?,?,?)",
                        ("alice", key, "mnote.page.save", "h", "{}", "c", iso(now - age, "milliseconds")))
    keys = svc.idempotency        # Idempotency-Key records: one answered two days ago, one now
    from hermes_service.idempotency import Outcome
    for key, age in (("old-key", 2 * DAY), ("new-key", 60)):
        keys.clock = lambda: now - age
        assert keys.claim("scope", key, "fp") is None
        keys.finish("scope", key, Outcome(200, "application/json", b"{}"))
    keys.clock = time.time
    return svc


EXPECTED = {"session mappings": 2, "transcripts": 0, "owner links": 1, "temp files": 1,
            "lock files": 2, "idempotency records": 1, "idempotency keys": 1, "run event logs": 0,
            "lock-table entries": 0, "event logs": 0, "home images": 0}


def test_dry_run_removes_nothing_and_says_what_would_go(stale_world):
    data = stale_world.config.data_dir
    before = snapshot(data)
    report = collect(stale_world, older_than=30 * DAY, dry_run=True)
    assert snapshot(data) == before
    assert report.counts == EXPECTED and not report.problems
    text = "\n".join(report.lines)
    for needle in ("would remove session stale-a of user alice", "session stale-b of user bob",
                   "session-gone.lock", "session-stale-b.lock", "owner link of dangling-old",
                   ".sessions.killed.tmp", "1 page-store idempotency record",
                   "1 expired Idempotency-Key record"):
        assert needle in text
    assert "fresh" not in text and "undated" not in text and "dangling-young" not in text
    assert "nothing was removed" in report.summary()


def test_gc_removes_exactly_what_is_stale(stale_world):
    svc, data = stale_world, stale_world.config.data_dir
    report = collect(svc, older_than=30 * DAY)
    assert report.counts == EXPECTED and not report.problems, report.lines
    store = svc.store
    assert {r["session_id"] for r in store.list()} == {"fresh", "undated"}
    assert store.owner("stale-a") is None and store.owner("stale-b") is None
    assert store.owner("dangling-old") is None and store.owner("dangling-young") == "alice"
    assert sorted(p.name for p in (data / "locks").iterdir()) == [
        "home-alice.lock", "session-..bad.lock", "session-fresh.lock"]
    assert not list((data / "sessions").glob("*/.sessions.*.tmp"))
    with sqlite3.connect(svc.extensions["mnote"].tools.store.path) as con:
        assert [r[0] for r in con.execute("SELECT idem_key FROM idempotency")] == ["k-new"]
    with sqlite3.connect(svc.idempotency.path) as con:
        assert [r[0] for r in con.execute("SELECT idem_key FROM requests")] == ["new-key"]
    again = collect(svc, older_than=30 * DAY)            # nothing left to do
    assert not any(again.counts.values()) and again.summary() == "gc: removed nothing"


def test_mappings_are_kept_without_older_than(stale_world):
    report = collect(stale_world, older_than=None)
    assert report.counts["session mappings"] == 0 and len(stale_world.store.list()) == 4
    assert report.counts["lock files"] == 1              # session-gone.lock only


def test_a_running_turn_keeps_its_session_and_its_lock(stubbed_app, stub):
    """In the same process (a blocked turn) and from another process (its file lock held)."""
    app = stubbed_app()
    svc = app.extensions["hermes_service"]
    old = time.time() - 40 * DAY
    svc.store.create(rec("busy-here", "alice", old))
    svc.store.create(rec("busy-there", "alice", old))
    stub.gate = threading.Event()
    c = app.test_client()
    turn = threading.Thread(target=lambda: c.post(
        "/api/v1/sessions/busy-here/messages", json={"message": "hi"}, headers={"X-API-Key": API_KEY}))
    turn.start()
    lock_there = svc.config.data_dir / "locks" / "session-busy-there.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT), path=str(lock_there))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        deadline = time.monotonic() + 10
        while not stub.calls and time.monotonic() < deadline:
            time.sleep(0.02)
        report = collect(svc, older_than=30 * DAY, in_service=True)
        assert report.counts["session mappings"] == 0, report.lines
        assert "kept session busy-here of user alice: a turn holds its lock" in report.lines
        assert "kept session busy-there of user alice: a turn holds its lock" in report.lines
        assert svc.store.get("busy-here") and svc.store.get("busy-there")
        assert (svc.config.data_dir / "locks" / "session-busy-here.lock").exists()
        assert lock_there.exists()
        assert "busy-here" in svc.conversations._local_locks        # held: not pruned
    finally:
        holder.stdin.close()
        holder.wait(10)
        stub.gate.set()
        turn.join(10)
    report = collect(svc, older_than=30 * DAY, in_service=True)
    assert {r["session_id"] for r in svc.store.list()} == {"busy-here"}   # just used again
    assert not lock_there.exists() and report.counts["session mappings"] == 1
    assert "busy-here" not in svc.conversations._local_locks    # idle now: pruned


def test_periodic_pass_sweeps_memory_of_the_service(stubbed_app, stub):
    app = stubbed_app({"mnote": {"events_retention_seconds": 0.1},
                       "retention": {"sessions_older_than": "30d"}})
    svc = app.extensions["hermes_service"]
    c = app.test_client()
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "alice"}
    res = c.post("/api/hermes/client/runs", headers=h, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "s_1", "message": "hi"})
    run_id = res.json["runId"]
    deadline = time.monotonic() + 10
    runs = svc.extensions["mnote"].runs
    while not runs.get(run_id, "alice").done and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    job = RetentionJob(svc)
    assert job.older_than == 30 * DAY and job.interval == 3600
    report = job.run_once()
    # a finished run whose whole log is on disk left memory when it ended (event_bounds.py)
    assert report.counts["event logs"] == 0 and report.counts["lock-table entries"] == 1
    assert svc.extensions["mnote"].runs._runs == {} and svc.conversations._local_locks == {}
    # the run's durable log went too (docs/data-and-durability.md §Runs and their events)
    assert report.counts["run event logs"] == 1
    assert not (svc.config.data_dir / "run-events" / f"{run_id}.jsonl").exists()
    assert report.counts["session mappings"] == 0 and len(svc.store.list("alice")) == 1


def test_periodic_job_follows_the_config_and_survives_a_failed_pass(make_config, monkeypatch):
    svc = build_services(make_config({"retention": {"interval_seconds": 0}}))
    job = RetentionJob(svc)
    passes = []

    def run_once():
        passes.append(time.monotonic())
        if len(passes) == 1:
            raise OSError("disk hiccup")          # logged; the next pass still runs
    monkeypatch.setattr(job, "run_once", run_once)
    monkeypatch.setattr(RetentionJob, "idle_check", 0.02)
    assert job.start() is False                   # interval 0: the thread idles
    time.sleep(0.2)
    assert passes == []
    svc.config = replace(svc.config,                          # what a reload hands over
                         retention=replace(svc.config.retention, interval_seconds=0.02))
    deadline = time.monotonic() + 10
    while len(passes) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    job.stop()
    job._thread.join(5)
    assert len(passes) >= 3 and not job._thread.is_alive()


def test_damaged_shard_is_reported_and_the_rest_is_cleaned(stale_world):
    shard = stale_world.config.data_dir / "sessions" / "bob" / "sessions.json"
    shard.write_text("{")
    report = collect(stale_world, older_than=30 * DAY)
    assert len(report.problems) == 1 and str(shard) in report.problems[0]
    assert report.counts["session mappings"] == 1 and stale_world.store.owner("stale-a") is None
    assert shard.read_text() == "{"
    assert (stale_world.config.data_dir / "locks" / "session-stale-b.lock").exists()


def run_gc(cfg_path, *args):
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(cfg_path), "gc",
                           *args], capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def test_gc_command(tmp_path):
    cfg = base_config(tmp_path)
    cfg["security"]["api_keys"] = [{"key_env": "UNSET_FOR_GC_TEST"}]   # gc needs no serving key
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    from hermes_service.installed import build_config
    svc = build_services(build_config(cfg, need_keys=False))
    svc.store.create(rec("old-one", "carol", time.time() - 10 * DAY))
    svc.store.create(rec("new-one", "carol", time.time()))
    out = run_gc(cfg_path, "--dry-run", "--older-than", "1w")
    assert out.returncode == 0, out.stderr
    assert "would remove session old-one of user carol" in out.stdout
    assert "gc: would remove 1 session mappings" in out.stdout and svc.store.get("old-one")
    out = run_gc(cfg_path, "--older-than", "2w")
    assert out.returncode == 0 and "gc: removed nothing" in out.stdout and svc.store.get("old-one")
    out = run_gc(cfg_path, "--older-than", "1w")
    assert out.returncode == 0 and "removed session old-one of user carol" in out.stdout
    assert svc.store.get("old-one") is None and svc.store.get("new-one")
    for bad, says in (("5m", "at least 1h"), ("30", "not a duration"), ("-1d", "not a duration")):
        out = run_gc(cfg_path, "--older-than", bad)
        assert out.returncode == 2 and says in out.stderr, out.stderr
    (tmp_path / "data" / "sessions" / "carol" / "sessions.json").write_text("[]")
    out = run_gc(cfg_path)
    assert out.returncode == 1 and "problem: skipped" in out.stdout and "1 problem(s)" in out.stdout
    (tmp_path / "data" / "sessions" / "_format.json").write_text("{")
    out = run_gc(cfg_path)
    assert out.returncode == 3 and "refusing to run" in out.stderr and "_format.json" in out.stderr


@pytest.mark.parametrize("retention,says", [
    ({"sessions_older_than": "30 days"}, "does not match"),
    ({"sessions_older_than": "30m"}, "at least 1h"),
    ({"interval_seconds": 5}, "too short"),
    ({"idempotency_window_seconds": 60}, "at least hermes.timeout_seconds"),
    ({"purge_transcript": True}, "did you mean 'purge_transcripts'"),
])
def test_retention_config_is_validated(make_config, retention, says):
    with pytest.raises(ConfigError) as exc:
        make_config({"retention": retention})
    assert any(says in p and ":retention" in p for p in exc.value.problems), exc.value.problems


def test_retention_defaults_keep_mappings(make_config):
    cfg = make_config().retention
    assert asdict(cfg) == {"interval_seconds": 3600, "sessions_older_than": None,
                           "purge_transcripts": False, "idempotency_window_seconds": 86400}
    assert make_config({"retention": {"interval_seconds": 0, "sessions_older_than": "90d",
                                      "purge_transcripts": True}}).retention.interval_seconds == 0


@pytest.mark.parametrize("dry_run", [True, False])
def test_purge_with_an_unreadable_state_db_keeps_that_mapping_and_cleans_the_rest(make_config,
                                                                                   dry_run):
    """One user's damaged state.db (or one SQLite cannot open) made the whole pass raise: no
    other user was cleaned, and the service's periodic pass failed every time."""
    svc = build_services(make_config())
    now = time.time()
    svc.store.create(rec("old-a", "alice", now - 40 * DAY, hermes_session_id="h-a"))
    svc.store.create(rec("old-b", "bob", now - 40 * DAY))
    db = svc.homes.ensure("alice").hermes_home / "state.db"
    db.write_bytes(b"not a database" * 100)
    report = collect(svc, older_than=30 * DAY, purge_transcripts=True, dry_run=dry_run)
    assert len(report.problems) == 1 and "old-a" in report.problems[0], report.lines
    assert "the mapping is kept" in report.problems[0]
    assert report.counts["session mappings"] == 1 and report.counts["transcripts"] == 0
    assert svc.store.get("old-a") is not None
    assert (svc.store.get("old-b") is None) != dry_run
    assert db.read_bytes() == b"not a database" * 100


def test_a_stuck_shard_lock_skips_that_user_and_cleans_the_rest(make_config):
    """A user's registry lock held by a stuck process made the pass raise filelock.Timeout
    after lock_timeout: nobody else was cleaned (and the CLI ended in a traceback)."""
    svc = build_services(make_config())
    svc.store.lock_timeout = 0.3
    store, data, now = svc.store, svc.config.data_dir, time.time()
    store.create(rec("old-a", "alice", now - 40 * DAY))
    store.create(rec("old-b", "bob", now - 40 * DAY))
    (data / "sessions" / "alice" / ".sessions.killed.tmp").write_text("{half")
    link = store.link_path("dangling-a")
    link.parent.mkdir(exist_ok=True)
    os.symlink("../../alice", link)
    os.utime(link, (now - 7200, now - 7200), follow_symlinks=False)
    shard_lock = data / "sessions" / "alice" / "sessions.json.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT), path=str(shard_lock))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        report = collect(svc, older_than=30 * DAY)
    finally:
        holder.communicate("", timeout=10)
    assert len(report.problems) == 1 and "user alice" in report.problems[0], report.lines
    assert str(shard_lock) in report.problems[0]
    assert report.counts["session mappings"] == 1 and store.get("old-b") is None
    assert store.get("old-a") and store.owner("dangling-a") == "alice"
    assert (data / "sessions" / "alice" / ".sessions.killed.tmp").exists()
    again = collect(svc, older_than=30 * DAY)           # the holder is gone: all of it now
    assert not again.problems and store.get("old-a") is None and store.owner("dangling-a") is None


def test_a_damaged_page_store_is_refused_with_its_name_not_a_traceback(tmp_path):
    """``data/mnote.db`` that is not an SQLite database: gc and the mnote operator commands
    exit 3 naming the file (the service start takes the same path), and the file is left
    as it was."""
    cfg = base_config(tmp_path)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    db = tmp_path / "data" / "mnote.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_bytes(b"not a database, " * 512)
    before = db.read_bytes()
    for args in (["gc", "--dry-run"], ["mnote", "export-page", "doc_1"]):
        out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(cfg_path),
                              *args], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
        assert out.returncode == 3, (args, out.stderr)
        assert "refusing to run" in out.stderr and "mnote.db" in out.stderr
        assert "Traceback" not in out.stderr
    assert db.read_bytes() == before
    from support.fixtures import ServiceProcess
    svc = ServiceProcess(tmp_path, cfg)
    with pytest.raises(RuntimeError) as exc:
        svc.start(timeout=15)
    assert "refusing to start" in str(exc.value) and "mnote.db" in str(exc.value)
    assert svc.proc.returncode == 3 and db.read_bytes() == before


def test_a_mapping_used_again_before_its_lock_is_taken_is_kept(stubbed_app, monkeypatch):
    """gc lists the stale mappings, then takes each one's turn lock; a turn that ran and
    ended in between made it fresh again. The mapping is re-checked under the lock (the
    registry's shard lock, ``SessionStore.delete(where=…)``) and kept."""
    from hermes_service import retention
    svc = stubbed_app().extensions["hermes_service"]
    svc.store.create(rec("raced", "alice", time.time() - 40 * DAY))
    real = retention._try_lock

    def lock_after_a_turn(path, create):
        if path.name == "session-raced.lock":       # a turn used it just now, then ended
            svc.store.update("raced", updated_at=iso(time.time()))
        return real(path, create)
    monkeypatch.setattr(retention, "_try_lock", lock_after_a_turn)
    report = collect(svc, older_than=30 * DAY)
    assert svc.store.get("raced") is not None
    assert report.counts["session mappings"] == 0
    assert any(line.startswith("kept session raced of user alice: used again after")
               for line in report.lines), report.lines

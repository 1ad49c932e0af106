"""Session registry durability (docs/data-and-durability.md): per-user shards and the owner
index under threads, processes, kill -9 and damaged files; migration of the single file."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC

import pytest

from hermes_service.errors import BadRequest, ServiceError
from hermes_service.session_store import CorruptShard, CorruptStore, SessionStore
from support.fixtures import API_KEY, ROOT, ServiceProcess, base_config

WRITER = """
import sys
sys.path.insert(0, {root!r})
from hermes_service.session_store import SessionStore
store = SessionStore({data!r})
users = {users!r}
for i in range({n}):
    sid = "{tag}-" + str(i)
    store.create({{"session_id": sid, "user_id": users[i % len(users)], "created_at": str(i)}})
    print("c", sid, flush=True)
    for shared in {shared!r}:
        store.update(shared, **{{"{tag}" + str(i): i}})
        print("u", shared, "{tag}" + str(i), flush=True)
"""


def writer(data, tag, n, users=("u",), shared=()):
    code = WRITER.format(root=str(ROOT), data=str(data), tag=tag, n=n, users=list(users),
                         shared=list(shared))
    return [sys.executable, "-c", code]


def acknowledged(out: str):
    """(created ids, {session: fields}) a writer printed before it ended."""
    created, updated = set(), {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "c":
            created.add(parts[1])
        elif len(parts) == 3 and parts[0] == "u":
            updated.setdefault(parts[1], set()).add(parts[2])
    return created, updated


def rec(sid, user="u", **extra):
    return {"session_id": sid, "user_id": user, "created_at": "2026-01-01T00:00:00+00:00", **extra}


def test_create_get_update_delete_list_roundtrip(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1", created_at="1"))
    store.create(rec("s2", "other", created_at="0"))
    assert store.update("s1", hermes_session_id="h")["hermes_session_id"] == "h"
    again = SessionStore(tmp_path)                    # restart
    assert again.get("s1")["hermes_session_id"] == "h" and again.get("s1")["updated_at"]
    assert [r["session_id"] for r in again.list("u")] == ["s1"]
    assert [r["session_id"] for r in again.list()] == ["s2", "s1"]     # oldest first, all users
    with pytest.raises(KeyError):
        store.create(rec("s1"))
    with pytest.raises(KeyError):                     # ids are unique across users
        store.create(rec("s1", "other"))
    with pytest.raises(ValueError):
        store.update("s1", user_id="other")
    assert store.delete("s1")["session_id"] == "s1" and store.get("s1") is None
    assert store.update("nope", x=1) is None and store.delete("nope") is None
    assert not store.link_path("s1").is_symlink()     # the owner link goes with the record
    shard = json.loads((tmp_path / "sessions" / "other" / "sessions.json").read_text())
    assert shard["version"] == 1 and list(shard["sessions"]) == ["s2"]   # the old file format


ALLOWED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.@:-"


def test_ids_with_every_allowed_character_round_trip(tmp_path):
    store = SessionStore(tmp_path)
    users = ["U" + ALLOWED[:60], "9" + ALLOWED[60:], "a.", "a@b:c-d_e", "x" * 128, "Ab", "ab"]
    sids = ["S" + ALLOWED[:60], "0" + ALLOWED[60:], "s.", "s@t:u-v_w.x", "y" * 128, "Cd", "cd",
            "mnote_doc_1_trace_1.0123456789ab"]
    for i, sid in enumerate(sids):
        store.create(rec(sid, users[i % len(users)], n=i))
    again = SessionStore(tmp_path)
    for i, sid in enumerate(sids):
        got = again.get(sid)
        assert got["session_id"] == sid and got["user_id"] == users[i % len(users)] and got["n"] == i
        assert again.update(sid, touched=True)["touched"] is True
    for user in users:                                # "Ab" and "ab" are different users
        assert {r["session_id"] for r in again.list(user)} == \
            {s for i, s in enumerate(sids) if users[i % len(users)] == user}
    for sid in sids:
        assert again.delete(sid)["session_id"] == sid and again.get(sid) is None
    assert list(again.links()) == []


@pytest.mark.parametrize("bad", ["", "-a", "a/b", "..", "a..b", "a b", "a\x00", "é", "x" * 129,
                                 "_owners", ".x", 5, None])
def test_unsafe_ids_are_refused_and_write_nothing(tmp_path, bad):
    store = SessionStore(tmp_path)
    before = sorted(p.name for p in (tmp_path / "sessions").rglob("*"))
    for record in (rec(bad), rec("ok", bad)):
        with pytest.raises(BadRequest) as exc:
            store.create(record)
        assert exc.value.code == "invalid_id"
    if isinstance(bad, str):
        with pytest.raises(BadRequest):
            store.get(bad)
        with pytest.raises(BadRequest):
            store.list(bad)
    assert sorted(p.name for p in (tmp_path / "sessions").rglob("*")) == before


def test_concurrent_creates_and_updates_from_threads_lose_nothing(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("shared", "u0"))

    def work(i):
        store.create(rec(f"t{i}", f"u{i % 7}", created_at=str(i)))
        store.update("shared", **{f"f{i}": i})       # read-modify-write of one record
        store.update(f"t{i}", n=i)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(work, range(200)))
    again = SessionStore(tmp_path)
    assert len(again.list()) == 201
    assert all(again.get(f"t{i}")["n"] == i for i in range(200))
    shared = again.get("shared")
    assert all(shared[f"f{i}"] == i for i in range(200))


def test_concurrent_creates_and_updates_from_two_processes_lose_nothing(tmp_path):
    store = SessionStore(tmp_path)
    for u in ("u1", "u2"):
        store.create(rec(f"shared-{u}", u))
    procs = [subprocess.Popen(writer(tmp_path, tag, 40, users=("u1", "u2", "u3"),
                                     shared=("shared-u1", "shared-u2")),
                              stdout=subprocess.PIPE, text=True) for tag in ("a", "b")]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    again = SessionStore(tmp_path)
    created = set().union(*(acknowledged(o)[0] for o in outs))
    assert {r["session_id"] for r in again.list()} == created | {"shared-u1", "shared-u2"}
    assert len(created) == 80
    for shared in ("shared-u1", "shared-u2"):
        fields = set().union(*(acknowledged(o)[1][shared] for o in outs))
        assert len(fields) == 80 and fields <= set(again.get(shared))


def test_kill_9_during_writes_keeps_every_acknowledged_change(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("shared", "u1"))
    for attempt, delay in enumerate((0.3, 0.55, 0.8)):
        proc = subprocess.Popen(writer(tmp_path, f"k{attempt}", 100000, users=("u1", "u2"),
                                       shared=("shared",)), stdout=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        created, updated = acknowledged(proc.communicate()[0])
        again = SessionStore(tmp_path)                 # every shard parses: never a torn file
        assert created <= {r["session_id"] for r in again.list()}
        assert updated.get("shared", set()) <= set(again.get("shared"))
    for user in ("u1", "u2"):                          # a killed write's temp file goes next time
        again.create(rec(f"after-{user}", user))
        assert not list((tmp_path / "sessions" / user).glob(".sessions.*.tmp"))


DIE_MID_WRITE = """
import resource, signal, sys
sys.path.insert(0, {root!r})
from hermes_service.session_store import SessionStore
store = SessionStore({data!r})
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)    # Python ignores it; now the kernel kills us
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))   # ... inside the write that crosses
for i in range(100000):
    store.create({{"session_id": "w{limit}-" + str(i), "user_id": "u1", "created_at": str(i)}})
    print("c", "w{limit}-" + str(i), flush=True)
    store.update("shared", **{{"w{limit}-" + str(i): i}})
    print("u", "shared", "w{limit}-" + str(i), flush=True)
"""


@pytest.mark.parametrize("limit", [1500, 6000])
def test_a_writer_killed_inside_a_shard_write_keeps_every_acknowledged_change(tmp_path, limit):
    """Deterministic half of "kill -9 at any moment": the kernel kills the writer (SIGXFSZ)
    in the middle of the write(2) that makes a file of it cross ``limit`` bytes, so the shard
    write in flight is always torn. An atomic write tears only its temp file; writing the
    shard in place would leave a shard that does not parse, every time."""
    store = SessionStore(tmp_path)
    store.create(rec("shared", "u1"))
    code = DIE_MID_WRITE.format(root=str(ROOT), data=str(tmp_path), limit=limit)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr      # died mid-write, not by an error
    created, updated = acknowledged(proc.stdout)
    assert created, "the writer acknowledged nothing before the limit"
    again = SessionStore(tmp_path)                 # the shard parses: never a torn file
    assert created <= {r["session_id"] for r in again.list("u1")}
    assert updated["shared"] <= set(again.get("shared"))
    assert list((tmp_path / "sessions" / "u1").glob(".sessions.*.tmp"))    # the torn temp file
    again.create(rec("after", "u1"))                                         # goes next write
    assert not list((tmp_path / "sessions" / "u1").glob(".sessions.*.tmp"))


def test_a_link_without_record_reads_as_absent_and_is_reused(tmp_path):
    """What a kill -9 between the owner link and the shard write leaves behind."""
    store = SessionStore(tmp_path)
    link = store.link_path("half")
    link.parent.mkdir(exist_ok=True)
    os.symlink("../../u", link)
    assert store.get("half") is None and store.owner("half") == "u"
    assert store.update("half", x=1) is None
    with pytest.raises(KeyError):                      # another user cannot take it meanwhile
        store.create(rec("half", "v"))
    assert store.create(rec("half", "u"))["session_id"] == "half"
    assert store.get("half")["user_id"] == "u"


def test_damaged_shard_is_refused_clearly_never_overwritten_and_others_keep_working(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("a1", "alice"))
    store.create(rec("b1", "bob"))
    shard = tmp_path / "sessions" / "bob" / "sessions.json"
    shard.write_text('{"version": 1, "sessions": {oops')
    for call in (lambda: store.get("b1"), lambda: store.list("bob"),
                 lambda: store.update("b1", x=1), lambda: store.delete("b1"),
                 lambda: store.create(rec("b2", "bob"))):
        with pytest.raises(CorruptShard) as exc:
            call()
        assert exc.value.status == 503 and exc.value.code == "session_store_corrupt"
        assert str(shard) in str(exc.value) and "not valid JSON" in str(exc.value)
        assert str(shard) not in exc.value.detail        # the HTTP detail names no path
    assert shard.read_text() == '{"version": 1, "sessions": {oops'
    assert store.get("b2") is None and not store.link_path("b2").exists()   # nothing half-made
    store.create(rec("a2", "alice"))                     # alice is unaffected
    assert store.update("a1", x=1)["x"] == 1 and len(store.list("alice")) == 2
    assert SessionStore(tmp_path).get("a2")              # and the service still opens


@pytest.mark.parametrize("content", [b"[]", b'{"version": 2, "sessions": {}}', b"\xff\xfe",
                                     b'{"version": 1, "sessions": {"b1": {"session_id": "b1", '
                                     b'"user_id": "alice"}}}'])
def test_every_kind_of_damaged_shard_is_refused(tmp_path, content):
    store = SessionStore(tmp_path)
    store.create(rec("b1", "bob"))
    (tmp_path / "sessions" / "bob" / "sessions.json").write_bytes(content)
    with pytest.raises(CorruptShard):
        store.get("b1")
    assert (tmp_path / "sessions" / "bob" / "sessions.json").read_bytes() == content


def test_damaged_owner_link_is_refused_for_that_session_only(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("ok", "alice"))
    link = store.link_path("bad")
    link.parent.mkdir(exist_ok=True)
    os.symlink("/etc", link)
    with pytest.raises(CorruptShard):
        store.get("bad")
    assert store.get("ok")["user_id"] == "alice"


def test_damaged_shard_through_the_api_refuses_only_that_user(stubbed_app):
    app = stubbed_app()
    c, h = app.test_client(), {"X-API-Key": API_KEY}
    alice = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=h).json["session_id"]
    bob = c.post("/api/v1/sessions", json={"user_id": "bob"}, headers=h).json["session_id"]
    data_dir = app.extensions["hermes_service"].config.data_dir
    (data_dir / "sessions" / "bob" / "sessions.json").write_text("{")
    res = c.get(f"/api/v1/sessions/{bob}", headers=h)
    assert res.status_code == 503 and res.json["code"] == "session_store_corrupt"
    assert "damaged" in res.json["detail"] and "sessions.json" not in res.json["detail"]
    assert c.get("/api/v1/sessions?user_id=bob", headers=h).status_code == 503
    res = c.get("/api/hermes/client/sessions", headers={**h, "X-Mnote-Actor-Id": "bob"})
    assert res.status_code == 503 and res.json["ok"] is False and "damaged" in res.json["message"]
    assert c.post(f"/api/v1/sessions/{alice}/messages", json={"message": "hi"},
                  headers=h).status_code == 200
    assert len(c.get("/api/v1/sessions?user_id=alice", headers=h).json["sessions"]) == 1
    assert (data_dir / "sessions" / "bob" / "sessions.json").read_text() == "{"


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"version": 99}', b"\xff\xfe"])
def test_damaged_layout_file_is_refused_at_open_and_never_overwritten(tmp_path, content):
    SessionStore(tmp_path)
    fmt = tmp_path / "sessions" / "_format.json"
    fmt.write_bytes(content)
    with pytest.raises(CorruptStore) as exc:
        SessionStore(tmp_path)
    assert str(fmt) in str(exc.value) and fmt.read_bytes() == content
    assert SessionStore.check(tmp_path) == [str(exc.value)]


# -- migration of the single data/sessions.json ------------------------------------------
def legacy_file(data_dir, n: int, users: int) -> dict:
    sessions = {f"s{i}": {"session_id": f"s{i}", "user_id": f"user{i % users}",
                          "created_at": f"2026-01-01T00:00:{i % 60:02d}+00:00", "status": "active",
                          "hermes_session_id": f"h{i}", "message_count": i, "kind": "v1"}
                for i in range(n)}
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "sessions.json").write_text(json.dumps({"version": 1, "sessions": sessions}))
    return sessions


def assert_migrated(data_dir, sessions: dict) -> None:
    store = SessionStore(data_dir)
    assert not (data_dir / "sessions.json").exists()
    [backup] = data_dir.glob("sessions.json.migrated-*")
    assert json.loads(backup.read_text())["sessions"] == sessions    # kept as it was
    assert {r["session_id"]: r for r in store.list()} == sessions
    for sid, record in sessions.items():
        assert store.get(sid) == record
    assert len(list(store.links())) == len(sessions)


def test_single_file_is_migrated_on_first_open(tmp_path):
    sessions = legacy_file(tmp_path, 250, 30)
    store = SessionStore(tmp_path)
    assert len(store.list("user3")) == len([s for s in sessions.values() if s["user_id"] == "user3"])
    assert_migrated(tmp_path, sessions)
    SessionStore(tmp_path)                                 # nothing left to do the second time


def test_migration_merges_and_keeps_newer_shard_records(tmp_path):
    """A rerun (after a crash) or a file an earlier-version process wrote later adds only
    what is missing."""
    sessions = legacy_file(tmp_path, 20, 3)
    (tmp_path / "sessions.json").rename(tmp_path / "held")
    store = SessionStore(tmp_path)
    store.create({**sessions["s1"], "message_count": 99})
    (tmp_path / "held").rename(tmp_path / "sessions.json")
    store = SessionStore(tmp_path)
    assert store.get("s1")["message_count"] == 99 and store.get("s2") == sessions["s2"]
    assert len(store.list()) == 20


@pytest.mark.parametrize("sessions", [{"x": 5}, {"x": {"session_id": "y", "user_id": "u"}},
                                      {"x": {"session_id": "x"}},
                                      {"x/y": {"session_id": "x/y", "user_id": "u"}},
                                      {"x": {"session_id": "x", "user_id": "../etc"}}])
def test_invalid_legacy_records_are_refused_and_never_overwritten(tmp_path, sessions):
    path = tmp_path / "sessions.json"
    path.write_text(json.dumps({"version": 1, "sessions": sessions}))
    before = path.read_bytes()
    with pytest.raises(CorruptStore) as exc:
        SessionStore(tmp_path)
    assert str(path) in str(exc.value) and path.read_bytes() == before
    assert not list((tmp_path / "sessions").glob("*/sessions.json"))


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"version": 99, "sessions": {}}',
                                     b"\xff\xfe"])
def test_corrupt_legacy_file_is_refused_and_never_overwritten(tmp_path, content):
    path = tmp_path / "sessions.json"
    path.write_bytes(content)
    with pytest.raises(CorruptStore) as exc:
        SessionStore(tmp_path)
    assert str(path) in str(exc.value) and path.read_bytes() == content
    assert SessionStore.check(tmp_path) == [str(exc.value)]


def test_legacy_file_with_a_duplicate_id_is_refused_not_half_migrated(tmp_path):
    """JSON keeps the last of two equal keys: migrating would drop the other record silently
    (here alice's session would become bob's). The file is refused, naming the id."""
    first = {"session_id": "s1", "user_id": "alice", "hermes_session_id": "h-alice"}
    second = {"session_id": "s1", "user_id": "bob", "hermes_session_id": "h-bob"}
    path = tmp_path / "sessions.json"
    path.write_text('{"version": 1, "sessions": {"s1": %s, "s2": %s, "s1": %s}}' % (
        json.dumps(first), json.dumps({**first, "session_id": "s2"}), json.dumps(second)))
    before = path.read_bytes()
    with pytest.raises(CorruptStore) as exc:
        SessionStore(tmp_path)
    assert str(path) in str(exc.value) and "duplicate" in str(exc.value) and "s1" in str(exc.value)
    assert path.read_bytes() == before and not list(tmp_path.glob("sessions.json.migrated-*"))
    assert not list((tmp_path / "sessions").glob("*/sessions.json"))
    assert SessionStore.check(tmp_path) == [str(exc.value)]


def test_unreadable_legacy_file_is_refused_with_its_name(tmp_path):
    """An unreadable old file (a folder here; EACCES or EIO alike) is CorruptStore — start-up
    exits 3 naming it, check-config reports it — not a traceback."""
    path = tmp_path / "sessions.json"
    path.mkdir()
    with pytest.raises(CorruptStore) as exc:
        SessionStore(tmp_path)
    assert str(path) in str(exc.value) and "unreadable" in str(exc.value) and path.is_dir()
    assert SessionStore.check(tmp_path) == [str(exc.value)]


MIGRATE = """
import sys
sys.path.insert(0, {root!r})
from hermes_service.session_store import SessionStore
SessionStore({data!r})
"""
MIGRATE_AND_DIE = """
import os, signal, sys
sys.path.insert(0, {root!r})
name, k, calls = {name!r}, {k}, [0]
real = getattr(os, name)
def dying(*a, **kw):
    calls[0] += 1
    if calls[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **kw)
setattr(os, name, dying)
from hermes_service.session_store import SessionStore
SessionStore({data!r})
"""


@pytest.mark.parametrize("name,k", [("symlink", 1), ("symlink", 61), ("symlink", 120),
                                    ("fsync", 3), ("fsync", 60), ("fsync", 200), ("replace", 2),
                                    ("replace", 9), ("replace", 21), ("rename", 1)])
def test_kill_9_at_each_step_of_the_migration_loses_nothing(tmp_path, name, k):
    """SIGKILL exactly at the k-th link / fsync / shard rename / final rename, then open again."""
    sessions = legacy_file(tmp_path, 120, 20)
    code = MIGRATE_AND_DIE.format(root=str(ROOT), name=name, k=k, data=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "sessions.json").exists()         # not committed: still the source
    assert json.loads((tmp_path / "sessions.json").read_text())["sessions"] == sessions
    assert_migrated(tmp_path, sessions)


def test_kill_9_at_random_moments_of_a_migration_loses_nothing(tmp_path):
    sessions = legacy_file(tmp_path, 1500, 150)
    rng = random.Random(9)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", MIGRATE.format(root=str(ROOT),
                                                                   data=str(tmp_path))])
        time.sleep(rng.uniform(0.3, 1.0))     # the interpreter itself starts in ~0.5 s
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not (tmp_path / "sessions.json").exists():
            break
    assert_migrated(tmp_path, sessions)


def test_service_refuses_to_start_on_a_corrupt_legacy_file(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sessions.json").write_text("{oops")
    svc = ServiceProcess(tmp_path, base_config(tmp_path))
    with pytest.raises(RuntimeError) as exc:
        svc.start(timeout=15)
    assert "refusing to start" in str(exc.value) and svc.proc.returncode == 3
    assert "sessions.json: not valid JSON" in str(exc.value)
    assert (tmp_path / "data" / "sessions.json").read_text() == "{oops"


def test_reader_sees_other_process_writes(tmp_path):
    reader = SessionStore(tmp_path)
    assert reader.get("p-0") is None
    subprocess.run(writer(tmp_path, "p", 1), check=True, capture_output=True)
    assert reader.get("p-0")["user_id"] == "u"
    assert isinstance(CorruptShard(tmp_path, "x"), ServiceError)


# -- sharper cases (docs/testing.md §Mutation testing: each kills mutants that survived) ------
def test_records_are_stamped_in_utc_and_fields_that_name_a_session_cannot_change(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1"))
    assert store.update("s1", x=1)["updated_at"].endswith("+00:00")
    with pytest.raises(ValueError) as exc:
        store.update("s1", user_id="other")
    assert str(exc.value) == "session_id and user_id of a session cannot change"
    with pytest.raises(KeyError) as exc:
        store.create(rec("s1"))
    assert exc.value.args == ("s1",)
    for record, field in ((rec("bad id"), "session_id"), (rec("s2", "bad user"), "user_id")):
        with pytest.raises(BadRequest) as exc:
            store.create(record)
        assert exc.value.detail.startswith(f"{field} must be ")


def test_delete_removes_the_record_from_its_shard_and_honours_where(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1", x=1))
    store.create(rec("s2", x=2))
    assert store.delete("s1", where=lambda r: r["x"] == 2) is None       # kept
    assert store.get("s1")["x"] == 1 and store.link_path("s1").is_symlink()
    assert store.delete("s1", where=lambda r: r["x"] == 1)["x"] == 1      # removed
    assert [r["session_id"] for r in store.list("u")] == ["s2"]            # from the shard too
    shard = json.loads((tmp_path / "sessions" / "u" / "sessions.json").read_text())
    assert list(shard["sessions"]) == ["s2"] and not store.link_path("s1").is_symlink()


def test_a_link_is_removed_only_for_its_owner(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1", "alice"))
    assert store._unclaim("s1", "mallory") is False and store.owner("s1") == "alice"
    bad = store.link_path("bad")
    bad.parent.mkdir(exist_ok=True)
    os.symlink("/etc", bad)
    assert store._unclaim("bad", "alice") is False and bad.is_symlink()


def test_check_reports_a_sessions_path_that_is_not_a_folder(tmp_path):
    (tmp_path / "sessions").write_text("not a folder")
    assert SessionStore.check(tmp_path) == [f"{tmp_path / 'sessions'}: not a folder; move it away"]
    with pytest.raises(CorruptStore):
        SessionStore(tmp_path)


def test_damaged_shard_detail_is_the_documented_sentence(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("b1", "bob"))
    (tmp_path / "sessions" / "bob" / "sessions.json").write_text("{")
    with pytest.raises(CorruptShard) as exc:
        store.get("b1")
    assert exc.value.detail == ("the session registry of this user is damaged and is not "
                                "overwritten; an operator must repair it (see the service log)")


def test_migration_counts_what_it_added_names_the_backup_in_utc_and_drops_stale_temp_files(
        tmp_path, monkeypatch):
    import re
    from datetime import datetime, timedelta
    store = SessionStore(tmp_path)
    assert store.migrate_legacy() == 0                    # nothing to migrate
    sessions = legacy_file(tmp_path, 12, 3)
    store.create({**sessions["s1"], "message_count": 99})     # already there: kept, not added
    (tmp_path / ".sessions.killed.tmp").write_text("{")       # a killed legacy writer's
    monkeypatch.setenv("TZ", "Etc/GMT-14")                     # a local time far from UTC
    time.tzset()
    try:
        before = datetime.now(UTC)
        assert store.migrate_legacy() == 11
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    [backup] = tmp_path.glob("sessions.json.migrated-*")
    stamp = re.fullmatch(r"sessions\.json\.migrated-(\d{8}T\d{12}Z)", backup.name).group(1)
    when = datetime.strptime(stamp, "%Y%m%dT%H%M%S%fZ").replace(tzinfo=UTC)
    assert before - timedelta(minutes=1) <= when <= datetime.now(UTC) + timedelta(minutes=1)
    assert not (tmp_path / ".sessions.killed.tmp").exists()
    for sid, record in sessions.items():                      # every record, in every shard
        assert store.get(sid) == ({**record, "message_count": 99} if sid == "s1" else record)


def test_migration_refuses_an_id_another_user_owns(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1", "zed"))
    legacy_file(tmp_path, 3, 3)                          # s1 belongs to user1 there
    with pytest.raises(CorruptStore) as exc:
        store.migrate_legacy()
    assert str(exc.value) == (f"{tmp_path / 'sessions.json'}: session s1 of user user1 is already "
                              "registered to user zed; resolve it by hand")
    assert (tmp_path / "sessions.json").exists()


HOLD_LEGACY = """
import sys
from filelock import FileLock
with FileLock({path!r}):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_migration_waits_for_an_older_writer_holding_the_legacy_lock(tmp_path):
    """An older version writing data/sessions.json holds sessions.json.lock: the migration
    waits for it (at most lock_timeout), never merges under it."""
    from filelock import Timeout
    sessions = legacy_file(tmp_path, 5, 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LEGACY.format(
        path=str(tmp_path / "sessions.json.lock"))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(Timeout):
            SessionStore(tmp_path, lock_timeout=0.2)
        assert (tmp_path / "sessions.json").exists()
    finally:
        holder.communicate("done\n", timeout=30)
    assert_migrated(tmp_path, sessions)


def test_count_is_the_number_of_owner_links_cached_for_max_age(tmp_path):
    store = SessionStore(tmp_path)
    assert store.count() == 0
    store.create(rec("s1"))
    store.create(rec("s2", "v"))
    assert store.count() == 0                      # the cached value, within max_age (30 s)
    assert store.count(max_age=0) == 2             # re-read
    half = store.link_path("half")                 # a link without a record counts until gc
    half.parent.mkdir(exist_ok=True)
    os.symlink("../../u", half)
    (store.owners / "not-a-fan").write_text("")    # only fan folders hold links
    assert store.count(max_age=0) == 3 and store.count() == 3
    assert sorted(sid for sid, _ in store.links()) == ["half", "s1", "s2"]


def test_a_shard_is_the_documented_format_utf8_compact_with_sorted_keys(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1", title="项目计划", b=1, a=2))
    raw = (tmp_path / "sessions" / "u" / "sessions.json").read_bytes()
    assert raw == json.dumps(json.loads(raw), ensure_ascii=False, sort_keys=True).encode()
    assert "项目计划".encode() in raw and b'"a": 2, "b": 1' in raw


def test_every_refusal_of_a_damaged_file_names_the_problem(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("b1", "bob"))
    shard = tmp_path / "sessions" / "bob" / "sessions.json"
    for content, reason in (
            (b'{"version": 1, "sessions": {"b1": 5}}', "invalid session record(s) ['b1'] (not records of user bob)"),
            (b'{"version": 1}', 'expected {"version": 1, "sessions": {...}}'),
            (b'{"version": 1, "sessions": {"b1": {"session_id": "b1", "user_id": "al"}, '
             b'"b2": {"session_id": "b2", "user_id": "al"}, "b3": {"session_id": "x", "user_id": "bob"}, '
             b'"b4": {"session_id": "b4", "user_id": "al"}}}',
             "invalid session record(s) ['b1', 'b2', 'b3'] (not records of user bob)")):
        shard.write_bytes(content)
        with pytest.raises(CorruptShard) as exc:
            store.get("b1")
        assert (exc.value.path, exc.value.reason) == (shard, reason)
    shard.unlink()
    shard.mkdir()                                                   # unreadable
    with pytest.raises(CorruptShard) as exc:
        store.get("b1")
    assert (exc.value.path, exc.value.reason) == (shard, "unreadable (Is a directory)")
    legacy = tmp_path / "sessions.json"
    legacy.write_text(json.dumps({"version": 1, "sessions": {"x": 5}}))
    assert SessionStore.check(tmp_path) == [
        f"{legacy}: invalid session record(s) ['x'] (no valid session_id and user_id); fix or move it "
        "away (it is never overwritten)"]
    legacy.unlink()
    fmt = tmp_path / "sessions" / "_format.json"
    fmt.write_text('{"version": 7}')
    assert SessionStore.check(tmp_path) == [
        f'{fmt}: expected {{"version": 1}} (a registry written by another version of '
        "hermes-service?); fix or move it away"]


def test_damaged_owner_links_name_the_problem(tmp_path):
    store = SessionStore(tmp_path)
    for sid, make, reason in (
            ("f1", lambda p: p.write_text("../../alice"), "not a symbolic link to ../../<user_id>"),
            ("f2", lambda p: os.symlink("/etc", p), "points to '/etc', not to ../../<user_id>"),
            ("f3", lambda p: os.symlink("/data/alice", p), "points to '/data/alice', not to ../../<user_id>")):
        link = store.link_path(sid)
        link.parent.mkdir(exist_ok=True)
        make(link)
        with pytest.raises(CorruptShard) as exc:
            store.owner(sid)
        assert (exc.value.path, exc.value.reason) == (link, reason)


def test_ids_are_refused_with_the_field_they_came_in(tmp_path):
    store = SessionStore(tmp_path)
    for call, field in ((lambda: store.get("bad id"), "session_id"),
                        (lambda: store.list("bad id"), "user_id")):
        with pytest.raises(BadRequest) as exc:
            call()
        assert exc.value.detail.startswith(f"{field} must be ")
    with pytest.raises(KeyError) as exc:
        store.create(rec("s1", "a")) and store.create(rec("s1", "b"))
    assert exc.value.args == ("s1",)


def test_the_owner_index_fans_out_by_two_hex_digits(tmp_path):
    import hashlib
    store = SessionStore(tmp_path)
    store.create(rec("s1"))
    link = store.link_path("s1")
    assert link.parent.name == hashlib.sha256(b"s1").hexdigest()[:2] and link.is_symlink()


def test_a_data_dir_is_made_with_its_parents_and_a_sessions_file_is_refused_clearly(tmp_path):
    SessionStore(tmp_path / "a" / "b" / "data").create(rec("s1"))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "sessions").write_text("")
    with pytest.raises(CorruptStore) as exc:
        SessionStore(tmp_path / "x")
    assert str(exc.value) == f"{tmp_path / 'x' / 'sessions'}: not a folder; move it away"


def test_list_is_oldest_first_by_created_at_across_users(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("late", "a", created_at="2026-03"))
    store.create(rec("early", "b", created_at="2026-01"))
    store.create(rec("mid", "a", created_at="2026-02"))
    store.create({"session_id": "undated", "user_id": "b"})      # no created_at: first
    assert [r["session_id"] for r in store.list()] == ["undated", "early", "mid", "late"]
    assert [r["session_id"] for r in store.list("a")] == ["mid", "late"]


def test_only_the_registrys_own_temp_files_are_swept(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1"))
    folder = tmp_path / "sessions" / "u"
    for name in (".sessions.left.tmp", "notes.tmp", ".sessions.keep"):
        (folder / name).write_text("x")
    assert [p.name for p in store.sweep_temp_files("u", dry_run=True)] == [".sessions.left.tmp"]
    assert (folder / ".sessions.left.tmp").exists()
    assert [p.name for p in store.sweep_temp_files("u")] == [".sessions.left.tmp"]   # default: remove
    assert sorted(p.name for p in folder.iterdir()) == [".sessions.keep", "notes.tmp",
                                                         "sessions.json", "sessions.json.lock"]
    (folder / ".sessions.again.tmp").write_text("x")
    store.update("s1", x=1)                                         # a write sweeps them too
    assert not (folder / ".sessions.again.tmp").exists() and (folder / "notes.tmp").exists()


def test_users_are_shard_folders_not_symlinks_or_files(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("s1", "alice"))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "sessions" / "mallory")
    (tmp_path / "sessions" / "file").write_text("")
    assert store.users() == ["alice"]


def test_a_dangling_link_is_dropped_only_when_old_and_without_record(tmp_path):
    store = SessionStore(tmp_path)
    store.create(rec("kept"))
    half = store.link_path("half")
    half.parent.mkdir(exist_ok=True)
    os.symlink("../../u", half)
    assert store.drop_dangling_link("nothing", 0) is False             # no link
    assert store.drop_dangling_link("half", 3600) is False              # too young
    assert store.drop_dangling_link("kept", 0) is False                 # it has its record
    assert store.drop_dangling_link("half", 0, dry_run=True) is True and half.is_symlink()
    assert store.drop_dangling_link("half", 0) is True                  # default: remove
    assert not half.is_symlink() and store.get("kept")


FILE_TOO_LARGE = """
import errno, resource, sys
sys.path.insert(0, {root!r})
from hermes_service.session_store import SessionStore
store = SessionStore({data!r})
store.create({{"session_id": "small", "user_id": "u"}})
resource.setrlimit(resource.RLIMIT_FSIZE, (400, 400))   # SIGXFSZ ignored: write() fails EFBIG
try:
    store.create({{"session_id": "big", "user_id": "u", "blob": "x" * 1000}})
except OSError as exc:
    print("refused", errno.errorcode[exc.errno])
"""


def test_a_failed_shard_write_raises_its_error_and_leaves_no_temp_file(tmp_path):
    SessionStore(tmp_path)                  # the layout file: written in this process too
    out = subprocess.run([sys.executable, "-c", FILE_TOO_LARGE.format(root=str(ROOT), data=str(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout == "refused EFBIG\n", out.stderr
    assert sorted(p.name for p in (tmp_path / "sessions" / "u").iterdir()) == ["sessions.json",
                                                                               "sessions.json.lock"]
    store = SessionStore(tmp_path)
    assert store.get("small") and store.get("big") is None


def test_a_change_is_durable_before_it_is_acknowledged(tmp_path, monkeypatch):
    """What kill -9 cannot show (the page cache survives a killed process), a power loss would:
    the owner link's folder is fsynced before the record is written, the record's data before
    its rename, and the shard's folder after it (docs/data-and-durability.md)."""
    store = SessionStore(tmp_path)
    store.create(rec("first"))                      # the user's folders exist from here on
    steps, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        steps.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        steps.append(("replace", str(dst)))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.create(rec("s2"))
    shard = str(tmp_path / "sessions" / "u" / "sessions.json")
    fan = str(store.link_path("s2").parent)
    names = [(op, "tmp" if ".sessions." in p else p) for op, p in steps]
    assert names[-4:] == [("fsync", fan), ("fsync", "tmp"), ("replace", shard),
                          ("fsync", str(tmp_path / "sessions" / "u"))]
    assert names[:-4] in ([], [("fsync", str(store.owners))])    # a new fan folder: its parent
    steps.clear()
    store.update("s2", x=1)
    assert [(op, "tmp" if ".sessions." in p else p) for op, p in steps] == [
        ("fsync", "tmp"), ("replace", shard), ("fsync", str(tmp_path / "sessions" / "u"))]

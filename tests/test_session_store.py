"""sessions.json durability (issue #2 item 9): threads, processes, kill -9, corruption."""
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import API_KEY, ROOT, ServiceProcess, base_config
from hermes_service.session_store import CorruptStore, SessionStore

WRITER = """
import sys, uuid
sys.path.insert(0, {root!r})
from hermes_service.session_store import SessionStore
store = SessionStore({path!r})
for i in range({n}):
    sid = "{tag}-" + str(i)
    store.create({{"session_id": sid, "user_id": "u", "created_at": "x"}})
    print(sid, flush=True)
"""


def writer(path, tag, n):
    return [sys.executable, "-c", WRITER.format(root=str(ROOT), path=str(path), tag=tag, n=n)]


def test_create_get_update_delete_roundtrip(tmp_path):
    store = SessionStore(tmp_path / "sessions.json")
    store.create({"session_id": "s1", "user_id": "u", "created_at": "1"})
    assert store.update("s1", hermes_session_id="h")["hermes_session_id"] == "h"
    assert SessionStore(tmp_path / "sessions.json").get("s1")["hermes_session_id"] == "h"  # restart
    with pytest.raises(KeyError):
        store.create({"session_id": "s1", "user_id": "u"})
    assert store.delete("s1")["session_id"] == "s1" and store.get("s1") is None
    assert store.update("nope", x=1) is None


def test_concurrent_creates_from_threads_lose_nothing(tmp_path):
    store = SessionStore(tmp_path / "sessions.json")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: store.create({"session_id": f"t{i}", "user_id": "u",
                                              "created_at": str(i)}), range(200)))
    assert len(SessionStore(tmp_path / "sessions.json").list()) == 200


def test_concurrent_creates_from_two_processes_lose_nothing(tmp_path):
    path = tmp_path / "sessions.json"
    procs = [subprocess.Popen(writer(path, tag, 60), stdout=subprocess.PIPE, text=True)
             for tag in ("a", "b")]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    ids = {r["session_id"] for r in SessionStore(path).list()}
    assert ids == set(outs[0]) | set(outs[1]) and len(ids) == 120


def test_kill_9_at_any_moment_keeps_every_acknowledged_session(tmp_path):
    path = tmp_path / "sessions.json"
    for attempt, delay in enumerate((0.3, 0.55, 0.8)):
        proc = subprocess.Popen(writer(path, f"k{attempt}", 100000), stdout=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        acknowledged = proc.communicate()[0].split()
        store = SessionStore(path)          # parses: never a torn file
        ids = {r["session_id"] for r in store.list()}
        assert set(acknowledged) <= ids
        assert not list(tmp_path.glob(".sessions.*.tmp"))  # a killed write's temp file is swept


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"version": 99, "sessions": {}}',
                                     b"\xff\xfe"])
def test_corrupt_file_is_refused_and_never_overwritten(tmp_path, content):
    path = tmp_path / "sessions.json"
    path.write_bytes(content)
    with pytest.raises(CorruptStore) as exc:
        SessionStore(path)
    assert str(path) in str(exc.value)
    assert path.read_bytes() == content


def test_service_refuses_to_start_on_corrupt_file(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sessions.json").write_text("{oops")
    svc = ServiceProcess(tmp_path, base_config(tmp_path))
    with pytest.raises(RuntimeError) as exc:
        svc.start(timeout=15)
    assert "refusing to start" in str(exc.value) and svc.proc.returncode == 3
    assert (tmp_path / "data" / "sessions.json").read_text() == "{oops"


def test_two_service_processes_sharing_a_data_dir_lose_no_session_and_survive_restart(tmp_path):
    """Real waitress processes, concurrent creates over HTTP from threads to both."""
    cfg = base_config(tmp_path)
    a, b = ServiceProcess(tmp_path, cfg).start(), ServiceProcess(tmp_path, cfg).start()
    try:
        def create(i):
            svc = (a, b)[i % 2]
            res = requests.post(svc.url + "/api/v1/sessions", json={"user_id": f"user{i % 3}"},
                                headers={"X-API-Key": API_KEY}, timeout=60)
            assert res.status_code == 200, res.text
            return res.json()["session_id"]
        with ThreadPoolExecutor(8) as pool:
            created = set(pool.map(create, range(40)))
    finally:
        a.stop()
        b.stop()
    c = ServiceProcess(tmp_path, cfg).start()   # restart keeps every session
    try:
        listed = set()
        for u in range(3):
            res = c.get(f"/api/v1/sessions?user_id=user{u}").json()
            listed |= {s["local_session_id"] for s in res["sessions"]}
        assert listed == created and len(created) == 40
    finally:
        c.stop()
    data = json.loads((tmp_path / "data" / "sessions.json").read_text())
    assert set(data["sessions"]) == created


def test_reader_sees_other_process_writes(tmp_path):
    path = tmp_path / "sessions.json"
    reader = SessionStore(path)
    assert reader.get("p-0") is None
    subprocess.run(writer(path, "p", 1), check=True, capture_output=True)
    assert reader.get("p-0")["user_id"] == "u"


@pytest.mark.parametrize("sessions", [{"x": 5}, {"x": {"session_id": "y", "user_id": "u"}},
                                      {"x": {"session_id": "x"}}])
def test_invalid_records_are_refused_at_start(tmp_path, sessions):
    path = tmp_path / "sessions.json"
    path.write_text(json.dumps({"version": 1, "sessions": sessions}))
    with pytest.raises(CorruptStore):
        SessionStore(path)

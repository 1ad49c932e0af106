"""The session registry under real service processes: migration at the first start and two
processes sharing one data dir (the registry itself: tests/unit/test_session_store.py)."""
import json
from concurrent.futures import ThreadPoolExecutor

import requests

from support.fixtures import API_KEY, ServiceProcess, base_config
from unit.test_session_store import legacy_file


def test_service_migrates_an_existing_data_dir_on_first_start(tmp_path):
    sessions = legacy_file(tmp_path / "data", 30, 3)
    svc = ServiceProcess(tmp_path, base_config(tmp_path)).start()
    try:
        listed = svc.get("/api/v1/sessions?user_id=user1").json()["sessions"]
        assert {s["local_session_id"] for s in listed} == \
            {sid for sid, r in sessions.items() if r["user_id"] == "user1"}
        assert svc.get("/api/v1/sessions/s4").json()["message_count"] == 4
    finally:
        svc.stop()
    assert not (tmp_path / "data" / "sessions.json").exists()
    assert len(list((tmp_path / "data").glob("sessions.json.migrated-*"))) == 1


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
    on_disk = set()
    for shard in (tmp_path / "data" / "sessions").glob("*/sessions.json"):
        on_disk |= set(json.loads(shard.read_text())["sessions"])
    assert on_disk == created

"""gc --purge-transcripts against transcripts real hermes turns wrote (the rest of retention:
tests/unit/test_retention.py)."""
import json
import time

import pytest

from unit.test_retention import DAY, iso, run_gc


@pytest.mark.e2e
def test_purge_transcripts_deletes_them_with_the_hermes_cli(start_service, tmp_path):
    """Two real turns; gc --purge-transcripts removes the stale session's Hermes transcript with
    `hermes sessions delete` and keeps the other one's."""
    from hermes_service.homes.hermes_state import session_summary
    svc = start_service()
    sids = []
    for text in ("first conversation", "second conversation"):
        sid = svc.post("/api/v1/sessions", json={"user_id": "purger"}).json()["session_id"]
        res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": text})
        assert res.status_code == 200, res.text
        sids.append((sid, res.json()["hermes_session_id"]))
    svc.stop()
    shard = tmp_path / "data" / "sessions" / "purger" / "sessions.json"
    data = json.loads(shard.read_text())
    data["sessions"][sids[0][0]]["updated_at"] = iso(time.time() - 60 * DAY)
    shard.write_text(json.dumps(data))
    hermes_home = tmp_path / "data" / "users" / "purger" / ".hermes"
    assert session_summary(hermes_home, sids[0][1]) and session_summary(hermes_home, sids[1][1])
    out = run_gc(svc.config_path, "--purge-transcripts", "--older-than", "30d")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"removed Hermes session {sids[0][1]} of user purger" in out.stdout
    assert f"removed session {sids[0][0]} of user purger" in out.stdout
    assert session_summary(hermes_home, sids[0][1]) is None          # gone from state.db
    assert session_summary(hermes_home, sids[1][1])["messageCount"] >= 2   # the other stays
    remaining = json.loads(shard.read_text())["sessions"]
    assert list(remaining) == [sids[1][0]]

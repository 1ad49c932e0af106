"""/api/v1/execute running the real hermes CLI (`hermes version`; the rest of the v1 API:
tests/unit/web/test_api_v1.py)."""
from unit.web.test_api_v1 import H, client  # noqa: F401  (client: a fixture)


def test_execute_example_shape(client):
    res = client().post("/api/v1/execute", json={"command": ["version"], "timeout": 30}, headers=H)
    assert res.status_code == 200
    assert {"success", "stdout", "stderr", "returncode"} <= set(res.json)
    assert res.json["success"] is True and "Hermes Agent" in res.json["stdout"]


def test_optional_fields_may_be_null(client):
    """Spec §3-§5 mark user_context, timeout (and initial_message) optional: null is absent."""
    c = client()
    res = c.post("/api/v1/sessions", json={"user_id": "user123", "initial_message": None},
                 headers=H)
    assert res.status_code == 200, res.json
    sid = res.json["session_id"]
    for ctx in (None, {"user_id": None}):
        res = c.post(f"/api/v1/sessions/{sid}/messages",
                     json={"message": "hi", "user_context": ctx}, headers=H)
        assert res.status_code == 200 and res.json["success"] is True, res.json
    res = c.post("/api/v1/execute", json={"command": ["version"], "user_context": None,
                                          "timeout": None}, headers=H)
    assert res.status_code == 200 and res.json["success"] is True, res.json


def test_a_huge_integer_timeout_is_capped_not_a_500(client):
    """JSON integers have no range: float(10**400) raised OverflowError before the cap was
    applied (HTTP 500 internal_error)."""
    res = client().post("/api/v1/execute",
                        data=b'{"command": ["version"], "timeout": 1' + b"0" * 400 + b"}",
                        headers={**H, "Content-Type": "application/json"})
    assert res.status_code == 200 and res.json["success"] is True, res.json

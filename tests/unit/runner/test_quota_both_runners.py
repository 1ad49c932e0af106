"""The home quota, the disk floor and the daily budget are checked before every turn on both
runners (``Processes.check_turn``: ``check_budget``, ``check_home_quota``; docs/sandbox.md
§Disk): a turn refused there starts no Hermes process. The seam: ``Processes.check_turn`` made
to refuse; the CLI runner's
process is the stub of ``CliRunner.run_process``, the warm runner's the fake ACP agent
(tests/support/fake_acp_agent.py). What the check itself measures: tests/unit/disk/test_quota.py."""
from __future__ import annotations

import pytest

from hermes_service.disk.quota import home_quota_error
from hermes_service.errors import RunError
from hermes_service.runner import TurnRequest
from unit.runner.test_acp_pool import agent_log, home, pool  # noqa: F401  (the pool fixture)


def refuse(*_a, **_kw):
    raise home_quota_error(3000, 2048)


def test_a_warm_turn_over_the_quota_is_refused_before_its_prompt(pool, tmp_path, monkeypatch):
    runner = pool()
    monkeypatch.setattr(runner.processes, "check_turn", refuse)
    h = home(tmp_path, "u1")
    req = TurnRequest(message="hi", resume_id=None, home=h, env=runner.env, family="mnote")
    with pytest.raises(RunError) as exc:
        runner.run_turn(req)
    assert exc.value.code == "home_quota_exceeded" and exc.value.status == 507
    assert agent_log(runner, "prompt") == []


def test_a_cli_turn_over_the_quota_is_refused_before_hermes_starts(stubbed_app, stub,
                                                                   monkeypatch):
    app = stubbed_app()
    svc = app.extensions["hermes_service"]
    c = app.test_client()
    from support.fixtures import API_KEY
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"},
                 headers={"X-API-Key": API_KEY}).json["session_id"]
    monkeypatch.setattr(svc.runner.processes, "check_turn", refuse)
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hi"},
                 headers={"X-API-Key": API_KEY})
    assert res.status_code == 507 and res.json["code"] == "home_quota_exceeded", res.json
    assert stub.calls == []

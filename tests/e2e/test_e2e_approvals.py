"""Dangerous commands need a human (docs/runners.md), through the real CLI.

An admin enables the terminal toolset; the model asks to run ``rm -rf ./tmp`` and the
provider answers every auxiliary call — Hermes's "smart" approval reviewer included — with
``APPROVE``. The template's approval mode (manual: a human, and a service run has none)
denies the command: the directory is still there.
"""
import pytest

from hermes_service import scripted_model as model_server

pytestmark = pytest.mark.e2e


def test_an_approving_reviewer_cannot_get_rm_rf_run(start_service, model, tmp_path, monkeypatch):
    monkeypatch.setattr(model_server, "AUX_REPLY", "APPROVE")    # the reviewer would approve
    svc = start_service({"hermes": {"toolsets": ["terminal"]}})
    sid = svc.post("/api/v1/sessions", json={"user_id": "carol"}).json()["session_id"]
    victim = tmp_path / "data" / "users" / "carol" / "tmp"
    victim.mkdir(parents=True)                  # (the home is made at the first turn)
    (victim / "keep.txt").write_text("still here")
    res = svc.post(f"/api/v1/sessions/{sid}/messages",
                   json={"message": '[[tools:terminal {"command": "rm -rf ./tmp"}]] approvals'})
    assert res.status_code == 200, res.text
    answer = res.json()["response"]
    assert "tools done: " in answer, answer                     # the call was made...
    assert (victim / "keep.txt").read_text() == "still here"    # ...and refused
    assert "BLOCKED" in answer or "denied" in answer.lower(), answer

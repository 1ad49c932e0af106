"""Honest outcomes, on both runners (docs/runners.md §Outcomes as they were, §One usage truth;
docs/operations.md §Logs): a provider whose streams break on every try is a failure, not a
``length`` answer; a turn's usage is the same in its answer, the run's ``run.completed``,
``main.py usage``, ``/metrics`` and the budget, ``estimated`` where the provider reported
none; every turn and every answer to a question leaves one JSON log line.

One real service per runner for the module (JSON log lines), real ``hermes`` / ``hermes acp``
against the scripted model: ``[[cut-every]]`` (every try cut), ``[[no-usage]]``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from support.fixtures import (
    ROOT,
    ServiceProcess,
    base_config,
    deep_merge,
    wait_for,
)
from support.sse_client import read_all

pytestmark = pytest.mark.e2e
P = "/api/hermes/client"
ACTORS = ("o_cut", "o_use", "o_log")


def _runner(name):
    return pytest.param(name, marks=pytest.mark.xdist_group(f"outcomes-{name}"))


@pytest.fixture(scope="module", params=[_runner("cli"), _runner("acp")])
def svc(request, tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp(f"outcomes-{request.param}")
    cfg = deep_merge(base_config(tmp, model.base_url),
                     {"mnote": {"runner": request.param},
                      "service": {"log_format": "json"},
                      "hermes": {"runner": request.param,
                                 "limits": {"daily_tokens": 10_000_000}}})
    from hermes_service.mnote.page_sqlite import SQLitePageStore
    store = SQLitePageStore(tmp / "data" / "mnote.db")
    store.add_workspace("ws_1")
    for who in ACTORS:
        store.add_member("ws_1", f"{who}_{request.param}", "editor")
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "t",
                       "blocks": [{"id": "b1", "type": "paragraph", "text": "p"}]})
    store.close()
    service = ServiceProcess(tmp, cfg).start()
    service.runner = request.param
    yield service
    service.stop()


def actor(svc, name):
    from support.fixtures import API_KEY
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": f"{name}_{svc.runner}"}


def say(svc, user, message):
    sid = svc.post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]
    return sid, svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": message})


def panel(svc, who, sid, message):
    body = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message}
    res = svc.post(f"{P}/runs", json=body, headers=actor(svc, who))
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    return run_id, [d for _, d in read_all(svc.url + f"{P}/events/{run_id}", actor(svc, who))]


def json_lines(svc) -> list[dict]:
    out = []
    for line in svc.log().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))      # every line of the json format parses
    return out


def turn_lines(svc, **match) -> list[dict]:
    return [r for r in json_lines(svc) if r.get("event") == "turn"
            and all(r.get(k) == v for k, v in match.items())]


def usage_row(svc, user) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                          str(svc.config_path), "usage", "--user", user, "--days", "1"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    [row] = [ln.split() for ln in out.stdout.splitlines() if ln.startswith(user + " ")]
    return row            # user requests prompt completion total estimated


def tokens_metric(svc) -> tuple[float, float]:
    text = svc.get("/metrics").text
    def value(kind):
        m = re.search(rf'^hermes_service_model_tokens_total{{kind="{kind}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0
    return value("prompt"), value("completion")


def test_a_provider_breaking_every_stream_is_a_failure_not_a_length_answer(svc, model):
    user = f"o_cut_v1_{svc.runner}"
    sid, res = say(svc, user, f"[[cut-every]] broken {svc.runner}")
    assert res.status_code == 502, res.text
    body = res.json()
    assert body["code"] == "upstream_unavailable" and "broke off" in body["detail"]
    # the pieces were taken back: the retry reaches the model once, without them
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": f"again {svc.runner}"})
    assert res.status_code == 200, res.text
    [req] = model.requests_with(f"again {svc.runner}")
    users = [m["content"] for m in req["messages"] if m["role"] == "user"]
    assert users == [f"again {svc.runner}"], users
    assert "continued" not in json.dumps(req["messages"])
    [line] = wait_for(lambda: turn_lines(svc, session=sid, outcome="failed") or None)
    assert line["code"] == "upstream_unavailable" and line["model_calls"] >= 2
    # the panel: run.failed with the contract's code
    _, evts = panel(svc, "o_cut", "mnote_doc_1_cut", "[[cut-every]] broken panel")
    assert evts[-1]["event"] == "run.failed", evts[-1]
    assert evts[-1]["code"] == "hermes_client_upstream_unavailable"
    # a stream cut once and continued whole is still an answer
    _, res = say(svc, f"o_cut1_{svc.runner}", "[[cut]] once")
    assert res.status_code == 200 and res.json()["finish_reason"] == "stop", res.text


def test_usage_is_one_truth_across_answer_usage_table_metrics_and_log(svc):
    for estimated, directive in ((False, ""), (True, "[[no-usage]] ")):
        user = f"o_use_{int(estimated)}_{svc.runner}"
        before = tokens_metric(svc)
        sid, res = say(svc, user, f"{directive}count me")
        assert res.status_code == 200, res.text
        usage = res.json()["usage"]
        assert usage["estimated"] is estimated and usage["total_tokens"] > 0
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        after = tokens_metric(svc)
        assert (after[0] - before[0], after[1] - before[1]) == (
            usage["input_tokens"], usage["output_tokens"])
        row = wait_for(lambda u=user: usage_row(svc, u), timeout=30)
        # requests: model calls only (Hermes's GET /v1/models probes are not counted)
        assert row[1:5] == [str(usage["requests"]), str(usage["input_tokens"]),
                            str(usage["output_tokens"]), str(usage["total_tokens"])]
        assert (row[5] != "0") is estimated
        [line] = wait_for(lambda s=sid: turn_lines(svc, session=s) or None)
        assert (line["input_tokens"], line["output_tokens"], line["estimated"]) == (
            usage["input_tokens"], usage["output_tokens"], estimated)
    # the panel's run.completed names the same numbers as the table
    who = "o_use"
    run_id, evts = panel(svc, who, "mnote_doc_1_use", "[[no-usage]] panel count")
    done = evts[-1]
    assert done["event"] == "run.completed", done
    row = usage_row(svc, f"{who}_{svc.runner}")
    assert done["usage"]["estimated"] is True
    assert row[2:5] == [str(done["usage"]["input_tokens"]), str(done["usage"]["output_tokens"]),
                        str(done["usage"]["total_tokens"])]
    [line] = wait_for(lambda: turn_lines(svc, run_id=run_id) or None)
    assert line["outcome"] == "ok" and line["runner"] == svc.runner
    assert line["total_tokens"] == done["usage"]["total_tokens"] and line["trace_id"]
    assert line["user"] == f"{who}_{svc.runner}" and line["family"] == "mnote"


def _reload(svc, cfg: dict, seq: int) -> None:
    import os
    import signal

    import yaml
    svc.config_path.write_text(yaml.safe_dump(cfg))
    os.kill(svc.proc.pid, signal.SIGHUP)
    path = svc.data_dir / "service-pids" / f"{svc.proc.pid}.json"

    def reloaded():
        try:
            status = json.loads(path.read_text())["reload"]
        except (OSError, ValueError, KeyError):
            return None
        return status if status["seq"] >= seq else None
    status = wait_for(reloaded, "the reload", timeout=30)
    assert status["ok"] is True, svc.log()


def test_a_flagged_command_nobody_can_approve_says_who_refused_or_runs(svc):
    """v1 has nobody to ask: ``python3 -c`` (flagged by Hermes 0.19.0: script execution via
    -c) is refused with a text naming why — not "User denied" — or, with
    ``hermes.approvals.unattended: {v1: run}``, runs in the sandbox."""
    call = json.dumps({"command": "python3 -c 'print(6*7)'"})
    _, res = say(svc, f"o_flag_deny_{svc.runner}", f"[[tools:terminal {call}]] flagged")
    assert res.status_code == 200, res.text
    answer = res.json()["response"]
    assert "flagged by Hermes as dangerous" in answer, answer
    assert "no one can approve it on the v1 API" in answer and "User denied" not in answer
    assert "hermes.approvals.unattended" in answer and "42" not in answer
    cfg = json.loads(json.dumps(svc.cfg))
    cfg["hermes"].setdefault("approvals", {})["unattended"] = {"v1": "run"}
    _reload(svc, cfg, 1)
    _, res = say(svc, f"o_flag_run_{svc.runner}", f"[[tools:terminal {call}]] flagged")
    assert res.status_code == 200, res.text
    answer = res.json()["response"]
    assert "42" in answer and "BLOCKED" not in answer, answer

"""End to end: a v1 message retried with its Idempotency-Key (docs/v1-api.md §Idempotent retries).

Real service (waitress subprocess) → real ``hermes`` CLI → scripted model, whose request log
shows how often the model was asked. One CLI turn in all: every retry is a replay.
"""
import threading

import pytest

from support.fixtures import wait_for

pytestmark = pytest.mark.e2e


def test_a_retried_v1_message_is_answered_once_also_after_a_restart(start_service, tmp_path,
                                                                    model):
    svc = start_service()
    res = svc.post("/api/v1/sessions", json={"user_id": "alice"},
                   headers={"Idempotency-Key": "create-1"})
    sid = res.json()["session_id"]
    marker = "idem-e2e-7f3a"
    key = {"Idempotency-Key": "msg-7f3a"}
    body = {"message": f"{marker} hello"}
    path = f"/api/v1/sessions/{sid}/messages"
    out = {}

    def first():
        out["first"] = svc.post(path, json=body, headers=key)
    t = threading.Thread(target=first)
    t.start()
    # a retry while the first turn runs (the client timed out): it waits for that answer
    wait_for(lambda: model.requests_with(marker), "the first turn to reach the model",
             log=svc.log)
    retry = svc.post(path, json=body, headers=key)
    t.join(180)
    first_res = out["first"]
    assert first_res.status_code == 200, first_res.text
    assert first_res.json()["response"] == f"echo #1: {marker} hello"
    assert "Idempotency-Replayed" not in first_res.headers
    assert retry.status_code == 200 and retry.headers["Idempotency-Replayed"] == "true"
    assert retry.content == first_res.content

    svc.stop()
    svc = start_service(tmp=tmp_path)            # a restart on the same data dir
    again = svc.post(path, json=body, headers=key)
    assert again.status_code == 200 and again.headers["Idempotency-Replayed"] == "true"
    assert again.json()["response"] == f"echo #1: {marker} hello"
    conflict = svc.post(path, json={"message": f"{marker} other"}, headers=key)
    assert conflict.status_code == 409 and conflict.json()["code"] == "idempotency_key_conflict"
    created = svc.post("/api/v1/sessions", json={"user_id": "alice"},
                       headers={"Idempotency-Key": "create-1"})
    assert created.headers["Idempotency-Replayed"] == "true"
    assert created.json()["session_id"] == sid
    assert len(model.requests_with(marker)) == 1       # the model answered the message once

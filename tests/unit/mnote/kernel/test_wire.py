"""The kernel adapter's wire format (docs/mnote-tools.md §The kernel adapter): the §2 envelope
sent, and which §3 answers are accepted for a call."""
from __future__ import annotations

import json

import pytest

from hermes_service.mnote.kernel.wire import (
    KERNEL_UNAVAILABLE,
    MAX_ANSWER_BYTES,
    KernelFailure,
    read_answer,
    request_envelope,
    unavailable,
)

ENV = {"toolName": "mnote.page.save", "workspaceId": "ws_1", "documentId": "doc_1",
       "actorId": "user_1", "sessionId": "s_1", "runId": "run_1", "toolCallId": "call_1",
       "traceId": "trace_1", "idempotencyKey": "idem_1", "dryRun": False,
       "capabilityScope": ["page.write"]}
ARGS = {"content": [{"type": "paragraph", "text": "x"}]}


def sent(tool="mnote.page.save", **over):
    return {**request_envelope(tool, {**ENV, **over}, ARGS, tool != "mnote.page.get"),
            **({"idempotencyKey": over["idempotencyKey"]} if "idempotencyKey" in over else {})}


def answer(s, **over):
    effect = "read" if s["toolName"] == "mnote.page.get" else \
        "dry_run" if s["dryRun"] else "write"
    out = {"ok": True, "toolName": s["toolName"], "toolCallId": s["toolCallId"],
           "traceId": s["traceId"], "result": {"commandName": "page.body.save"},
           "audit": {"effect": effect, "commandId": "cmd_1" if effect == "write" else None,
                     "workspaceId": "ws_1", "documentId": "doc_1"}, "error": None}
    out.update(over)
    return json.dumps(out).encode()


def test_the_request_is_the_section_2_envelope_with_every_field():
    s = request_envelope("mnote.page.get", {**ENV, "toolName": "mnote.page.get",
                                            "idempotencyKey": None, "dryRun": True}, {}, False)
    assert list(s) == ["toolName", "workspaceId", "documentId", "actorId", "sessionId", "runId",
                       "toolCallId", "traceId", "idempotencyKey", "dryRun", "capabilityScope",
                       "args"]
    assert s["dryRun"] is False and s["idempotencyKey"] is None and s["args"] == {}


def test_a_valid_success_and_the_contracts_shorter_forms_are_accepted():
    s = sent()
    got = read_answer(answer(s), s)
    assert (got.ok, got.effect, got.command_id) == (True, "write", "cmd_1")
    short = json.loads(answer(s))
    del short["error"], short["audit"]["workspaceId"], short["audit"]["documentId"]
    assert read_answer(json.dumps(short).encode(), s).ok
    fail = {"ok": False, "toolName": s["toolName"], "toolCallId": "call_1", "traceId": "trace_1",
            "error": {"code": "mnote_tool_permission_denied", "message": "无页面写权限"}}
    got = read_answer(json.dumps(fail).encode(), s)
    assert (got.ok, got.code, got.message) == (False, "mnote_tool_permission_denied", "无页面写权限")


@pytest.mark.parametrize("raw, reason", [
    (b"<html>no</html>", "bad_answer"),
    (b'{"ok": tru', "bad_answer"),
    (b"\xff\xfe", "bad_answer"),
    (b"[1, 2]", "bad_answer"),
    (b'{"ok": NaN}', "bad_answer"),
    (b"[" * 100000 + b"]" * 100000, "bad_answer"),
    (b'{"ok": true, "result": ' + b"[" * 65 + b"]" * 65 + b"}", "bad_answer"),
    (b" " * (MAX_ANSWER_BYTES + 1), "too_large"),
])
def test_what_is_not_an_envelope_is_a_failure(raw, reason):
    with pytest.raises(KernelFailure) as err:
        read_answer(raw, sent())
    assert err.value.reason == reason and not err.value.retryable
    assert raw[:20].decode("utf-8", "replace") not in err.value.detail or raw[:1] == b" "


@pytest.mark.parametrize("over, reason", [
    ({"toolCallId": "call_other"}, "wrong_call"),
    ({"traceId": "trace_other"}, "wrong_call"),
    ({"toolName": "mnote.page.get"}, "wrong_call"),
    ({"audit": {"effect": "write", "commandId": "c", "documentId": "doc_2"}}, "wrong_call"),
    ({"ok": "yes"}, "bad_answer"),
    ({"result": None}, "bad_answer"),
    ({"result": [1]}, "bad_answer"),
    ({"audit": {"effect": "write", "commandId": None}}, "bad_answer"),
    ({"audit": {"effect": "write", "commandId": ""}}, "bad_answer"),
    ({"audit": {"effect": "dry_run", "commandId": None}}, "bad_answer"),
    ({"audit": "write"}, "bad_answer"),
    ({"error": {"code": "mnote_tool_conflict", "message": "x"}}, "bad_answer"),
])
def test_a_success_that_breaks_a_rule_is_a_failure(over, reason):
    s = sent()
    with pytest.raises(KernelFailure) as err:
        read_answer(answer(s, **over), s)
    assert err.value.reason == reason


def test_effects_must_fit_the_call():
    dry = sent(dryRun=True)
    assert read_answer(answer(dry), dry).effect == "dry_run"
    with pytest.raises(KernelFailure, match=r"dry_run with an audit\.commandId"):
        read_answer(answer(dry, audit={"effect": "dry_run", "commandId": "c"}), dry)
    get = sent("mnote.page.get", toolName="mnote.page.get")
    assert read_answer(answer(get, result={"documentId": "doc_1"}), get).effect == "read"
    with pytest.raises(KernelFailure) as err:      # another page's content
        read_answer(answer(get, result={"documentId": "doc_secret", "title": "x"}), get)
    assert err.value.reason == "wrong_call"


@pytest.mark.parametrize("error, result, audit", [
    ({"code": "PERMISSION_DENIED", "message": "x"}, None, None),
    ({"code": "mnote_tool_conflict", "message": 3}, None, None),
    ({"code": "mnote_tool_conflict", "message": "x" * 2001}, None, None),
    ("denied", None, None),
    ({"code": "mnote_tool_conflict", "message": "x"}, {"title": "leak"}, None),
    ({"code": "mnote_tool_conflict", "message": "x"}, None, {"effect": "write", "commandId": "c"}),
])
def test_a_failure_that_breaks_a_rule_is_a_failure(error, result, audit):
    s = sent()
    body = {"ok": False, "toolName": s["toolName"], "toolCallId": "call_1", "traceId": "trace_1",
            "result": result, "error": error, **({"audit": audit} if audit else {})}
    with pytest.raises(KernelFailure) as err:
        read_answer(json.dumps(body).encode(), s)
    assert err.value.reason == "bad_answer"


def test_the_models_message_names_the_key_a_retry_may_reuse():
    err = unavailable("timeout", sent())
    assert err.code == KERNEL_UNAVAILABLE and "idem_1" in err.message
    assert "idem_1" not in unavailable("timeout", sent(dryRun=True)).message

"""The kernel adapter's wire format: the tool contract's own envelopes, nothing else.

docs/mnote-tools.md §The kernel adapter. A call leaves this service as the contract's §2
input envelope (the §2 form: tool fields under ``args``; every §2 field present, the
token-bound ones forced by the tool gateway) and comes back as its §3 output envelope:

* :func:`request_envelope` — the §2 envelope of a validated call;
* :func:`read_answer` — a kernel's answer checked against the call it answers (the echoed
  ``toolName``/``toolCallId``/``traceId``, the page, the effect the call can have, a write's
  ``audit.commandId``, an error's code), as a :class:`KernelAnswer`; anything else raises
  :class:`KernelFailure`;
* :class:`KernelFailure` — a kernel that is down, slow or answers something that is not a
  valid envelope for this call: one ``reason`` (a metric label), a ``detail`` for the log
  (never the kernel's body), ``retryable`` for a transport failure. The model sees
  :data:`KERNEL_UNAVAILABLE` with the reason's message (:func:`unavailable`).

Standard library and :mod:`.page_store`'s :class:`ToolError` only: the conformance check and
the reference kernel use the same rules.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..page_store import ToolError
from ..schemas import READ_TOOLS

#: the code of a tool call the kernel could not answer (down, slow, not a valid envelope)
KERNEL_UNAVAILABLE = "mnote_tool_kernel_unavailable"
#: the largest answer read from a kernel (bytes of JSON; more is the ``too_large`` failure)
MAX_ANSWER_BYTES = 4 * 1024 * 1024
#: the longest ``error.message`` passed through from a kernel (characters)
MAX_MESSAGE_CHARS = 2000
#: the deepest nesting of arrays and objects accepted in an answer (a deeper one could pass
#: the parser here and fail an encoder later: the tool endpoint's, the plugin's, Hermes's)
MAX_DEPTH = 64
#: an ``error.code`` a kernel may answer (the contract's codes all have this shape)
CODE_PATTERN = re.compile(r"mnote_tool_[a-z0-9_]{1,64}")

#: reason → what the model is told (Chinese, like the contract's messages). The reasons are
#: the ``outcome`` labels of ``hermes_service_kernel_calls_total`` besides ``ok``.
REASONS = {
    "unreachable": "无法连接 mnote 内核",
    "timeout": "mnote 内核未在时限内答复",
    "unauthorized": "mnote 内核拒绝了本服务的凭据",
    "http_status": "mnote 内核答复了错误状态",
    "exit_status": "mnote 内核命令异常退出",
    "too_large": "mnote 内核的答复超过大小上限",
    "bad_answer": "mnote 内核的答复不是合同的输出信封",
    "wrong_call": "mnote 内核的答复不属于本次工具调用",
    "tls": "mnote 内核的 TLS 证书未通过验证",
    "busy": "同时进行的 mnote 内核调用过多",
}


class KernelFailure(Exception):
    """The kernel gave no usable answer. ``reason``: a key of :data:`REASONS`; ``detail``:
    what the log says (sizes, statuses, the failing field — never the body); ``retryable``:
    a transport failure, worth another attempt with the same envelope."""

    def __init__(self, reason: str, detail: str, retryable: bool = False):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.retryable = reason, detail, retryable


class KernelToolError(ToolError):
    """A tool failure with the kernel's own ``code`` (or :data:`KERNEL_UNAVAILABLE`)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def unavailable(reason: str, envelope: dict) -> KernelToolError:
    """The :data:`KERNEL_UNAVAILABLE` error of a call that failed for ``reason``. A write's
    message names its ``idempotencyKey``: whether it took effect is unknown, and a retry
    with that key never writes twice."""
    message = REASONS.get(reason, REASONS["bad_answer"]) + "，请稍后重试"
    key = envelope.get("idempotencyKey")
    if key and envelope.get("dryRun") is False and envelope["toolName"] not in READ_TOOLS:
        message += f"；写入是否已生效未知，重试时请传 idempotencyKey: {key}（同一键不会重复写入）"
    return KernelToolError(KERNEL_UNAVAILABLE, message)


@dataclass(frozen=True)
class KernelAnswer:
    """A kernel's answer to one call: ``ok`` with ``result``, ``effect`` (read | write |
    dry_run) and ``command_id`` (a write's), or not ``ok`` with ``code`` and ``message``."""
    ok: bool
    result: dict | None = None
    effect: str = "none"
    command_id: str | None = None
    code: str | None = None
    message: str | None = None


#: the §2 fields, in the contract's order
ENVELOPE_FIELDS = ("toolName", "workspaceId", "documentId", "actorId", "sessionId", "runId",
                   "toolCallId", "traceId", "idempotencyKey", "dryRun", "capabilityScope", "args")


def request_envelope(tool: str, env: dict, args: dict, writes: bool) -> dict:
    """The §2 envelope sent for a validated call: every §2 field, ``args`` holding the tool
    fields (never §4's flat form), ``dryRun`` false for a read, ``idempotencyKey`` null for a
    read that names none."""
    return {"toolName": tool, "workspaceId": env["workspaceId"], "documentId": env["documentId"],
            "actorId": env["actorId"], "sessionId": env["sessionId"], "runId": env["runId"],
            "toolCallId": env["toolCallId"], "traceId": env["traceId"],
            "idempotencyKey": env.get("idempotencyKey"),
            "dryRun": bool(writes and env.get("dryRun", False)),
            "capabilityScope": list(env.get("capabilityScope", ())), "args": args}


def encode(envelope: Any) -> bytes:
    """The request body: UTF-8 JSON."""
    return json.dumps(envelope, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) \
            else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if level + 1 > MAX_DEPTH:
                    return level + 1
                stack.append((child, level + 1))
        deepest = max(deepest, level)
    return deepest


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON (UTF-8, no NaN/Infinity, nesting at most :data:`MAX_DEPTH`);
    KernelFailure ``bad_answer``/``too_large`` otherwise."""
    if len(raw) > MAX_ANSWER_BYTES:
        raise KernelFailure("too_large", f"{len(raw)} bytes (limit {MAX_ANSWER_BYTES})")
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        kind = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else \
            "nested too deep" if isinstance(exc, RecursionError) else "not JSON"
        raise KernelFailure("bad_answer", f"the answer is {kind} ({len(raw)} bytes)") from None
    if isinstance(value, (dict, list)) and _depth(value) > MAX_DEPTH:
        raise KernelFailure("bad_answer", f"the answer nests deeper than {MAX_DEPTH} levels")
    return value


def _expected_effect(sent: dict) -> str:
    if sent["toolName"] in READ_TOOLS:
        return "read"
    return "dry_run" if sent.get("dryRun") else "write"


def read_answer(raw: bytes, sent: dict) -> KernelAnswer:
    """Check a kernel's §3 answer ``raw`` against the envelope ``sent``.

    Accepted: §3's full envelope and the shorter ones of §4's examples (``error`` left out
    of a success, ``result``/``audit`` of a failure). Required: ``ok`` a boolean; the echoed
    ``toolName``, ``toolCallId`` and ``traceId`` equal to the sent ones, and ``audit``'s (and
    a page.get result's) ``workspaceId``/``documentId`` when given (else ``wrong_call``); a
    success: ``result`` an object, ``audit.effect`` the one the call can have (read;
    dry_run for a dryRun write; write), ``audit.commandId`` a non-empty string on a write
    and null otherwise, no ``error``; a failure: ``error.code`` matching
    :data:`CODE_PATTERN`, ``error.message`` a string of at most :data:`MAX_MESSAGE_CHARS`,
    no ``result``, an ``audit`` (if any) of effect none. KernelFailure ``bad_answer`` /
    ``wrong_call`` / ``too_large`` otherwise."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise KernelFailure("bad_answer",
                            f"the answer is a JSON {type(data).__name__}, not an object")
    for key in ("toolName", "toolCallId", "traceId"):
        if data.get(key) != sent[key]:
            raise KernelFailure("wrong_call", f"its {key} is not the call's")
    audit = data.get("audit")
    if audit is not None and not isinstance(audit, dict):
        raise KernelFailure("bad_answer", "audit is not an object")
    audit = audit or {}
    _same_page(audit, sent, "audit")
    ok = data.get("ok")
    if ok is True:
        return _success(data, audit, sent)
    if ok is False:
        return _failure(data, audit)
    raise KernelFailure("bad_answer", "ok is not a boolean")


def _same_page(obj: dict, sent: dict, where: str) -> None:
    for key in ("workspaceId", "documentId"):
        if obj.get(key) is not None and obj.get(key) != sent[key]:
            raise KernelFailure("wrong_call", f"{where}.{key} is not the call's page")


def _success(data: dict, audit: dict, sent: dict) -> KernelAnswer:
    result, effect, command_id = data.get("result"), audit.get("effect"), audit.get("commandId")
    if not isinstance(result, dict):
        raise KernelFailure("bad_answer", "ok is true but result is not an object")
    if data.get("error") is not None:
        raise KernelFailure("bad_answer", "ok is true but error is set")
    expected = _expected_effect(sent)
    if effect != expected:
        raise KernelFailure("bad_answer", f"audit.effect is {str(effect)[:20]!r}, the call can "
                                          f"only have {expected!r}")
    if expected == "write":
        if not (isinstance(command_id, str) and 0 < len(command_id) <= 256):
            raise KernelFailure("bad_answer", "a write without audit.commandId (a string of "
                                              "1-256 characters)")
    elif command_id is not None:
        raise KernelFailure("bad_answer", f"a {expected} with an audit.commandId")
    if expected == "read":
        _same_page(result, sent, "result")
    return KernelAnswer(True, result, effect, command_id)


def _failure(data: dict, audit: dict) -> KernelAnswer:
    error = data.get("error")
    if not isinstance(error, dict):
        raise KernelFailure("bad_answer", "ok is false but error is not an object")
    code, message = error.get("code"), error.get("message")
    if not (isinstance(code, str) and CODE_PATTERN.fullmatch(code)):
        raise KernelFailure("bad_answer", "error.code is not an mnote_tool_* code")
    if not (isinstance(message, str) and len(message) <= MAX_MESSAGE_CHARS):
        raise KernelFailure("bad_answer", f"error.message is not a string of at most "
                                          f"{MAX_MESSAGE_CHARS} characters")
    if data.get("result") is not None:
        raise KernelFailure("bad_answer", "ok is false but result is set")
    if audit.get("effect", "none") != "none" or audit.get("commandId") is not None:
        raise KernelFailure("bad_answer", "ok is false but audit records an effect")
    return KernelAnswer(False, code=code, message=message)

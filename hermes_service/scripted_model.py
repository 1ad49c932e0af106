"""Scripted OpenAI-compatible model server: the test suite's model, and the demo's.

The end-to-end tests and benches run the real Hermes CLI against it; ``main.py --demo`` /
``make demo`` (the installed demo, :func:`hermes_service.installed.demo`) serves it as a labelled
stand-in provider with a planner of its own (``ScriptedModel(planner=...)``) on top of the
directives below.

Standard library only.  One server can be shared by many concurrent tests:
the reply to each request is chosen by DIRECTIVES written in the text of the
LAST user message of that request, so every test carries its own behaviour in
its own message.

Usage::

    model = ScriptedModel("scripted-model").start()
    write_hermes_config(home, model.base_url, model.model_id, "SCRIPTED_API_KEY")
    env = hermes_env(home, "SCRIPTED_API_KEY")
    ...                       # run `hermes chat --query=... -Q --source tool`
    model.main_requests()     # main-turn request bodies seen so far
    model.stop()

Endpoints
---------
``GET /v1/models``, ``GET /v1/models/{id}`` (404 for another id),
``POST /v1/chat/completions``: SSE ``chat.completion.chunk`` frames when the
body has ``"stream": true`` (role chunk, content or tool-call chunks, finish
chunk, a usage chunk when ``stream_options.include_usage`` is true, then
``data: [DONE]``); a plain ``chat.completion`` JSON object otherwise.
Anything else: 404 with an OpenAI-style JSON error body.

Directives (in the last user message; first match in this order wins)
-----------------------------------------------------------------------
``[[status:CODE]]``
    Answer HTTP CODE (any 400-599, e.g. 401, 429, 500) with an OpenAI-style
    body ``{"error": {"message", "type", "param", "code"}}``.  429 also sends
    ``Retry-After: 1``.
``[[hang]]``
    Accept the request and never answer.  The handler waits until
    ``stop()`` is called or the client closes its connection, then drops the
    connection without a response.
``[[tools:NAME {json args} ; NAME2 {json args}]]``
    A list of tool calls separated by ``;``.  NAME matches
    ``[A-Za-z0-9_.:-]+``; the JSON object after it is optional (``{}`` when
    omitted) and is parsed with a real JSON decoder, so ``;`` and ``]]`` are
    allowed inside JSON strings.  Example::

        [[tools:read_file {"path": "a;b.txt"} ; terminal {"command": "ls"}]]

    Step k (k = number of ``role: tool`` messages after the last user
    message) answers with tool call k (one call per assistant turn, streamed
    in several argument fragments, ``finish_reason: tool_calls``, unique id
    ``call_<hex>``).  When every call has a result, the reply is the text
    ``tools done: <result1> || <result2> ...`` (each tool message's content
    verbatim, in order).  If the tool to call next is not in the request's
    ``tools`` array the reply is the text ``tool not offered: NAME``.
``[[narrate]]``
    Modifier of ``[[tools:…]]``: each tool-call reply also carries the text ``calling
    NAME.`` before its call (streamed first, as models say what they are about to do).
``[[then-hang]]``
    Modifier of ``[[tools:…]]``: once every call has its result, hang (as
    ``[[hang]]``) instead of replying.
``[[tools-offered]]``
    Reply with the sorted names of the tools in the request's ``tools``
    array, joined by ``,``; ``(none)`` when no tools are offered (an empty
    reply would make Hermes retry and print "No reply" instead).
``[[recall]]``
    Reply with the text of every EARLIER user message joined by `` | ``
    (proves the model saw the previous turns of a resumed session).
``[[slow:S]]``, ``[[slow:S:N]]``
    Modifier, combinable with the text replies above (echo, recall,
    tools-offered, tools done): the text is streamed in ~N pieces (default 5)
    spread over S seconds (float).  Stops early on ``stop()`` or a closed client.
``[[gate:NAME]]``
    Modifier of any reply: hold it until :meth:`ScriptedModel.release` ``(NAME)``
    is called (then answer as without it), ``stop()`` is called or the client
    closes its connection (then drop it, as ``[[hang]]``).  NAME matches
    ``[A-Za-z0-9_-]+``.  A turn a test keeps in flight for as long as it needs.
``[[reasoning]]``
    Modifier: before the text, stream :data:`REASONING_TEXT` as
    ``reasoning_content`` deltas (what DeepSeek/Qwen-style providers send).
``[[think]]``
    Modifier: the content itself starts with ``<think>`` + :data:`REASONING_TEXT`
    + ``</think>`` before the text (models that inline their reasoning).
``[[empty]]``
    The reply has empty content (``finish_reason: stop``), streamed or not.
``[[cut]]``
    The stream sends part of the text, then the connection is closed without
    a ``finish_reason`` and without ``[DONE]`` (a provider stream broken
    mid-answer).  Only the first request carrying the directive is cut; the
    continuation Hermes asks for afterwards is answered normally.
``[[length]]``
    Modifier of a text reply: it ends with ``finish_reason: "length"`` (the provider's
    output limit reached), streamed or not. It also holds for the continuations Hermes asks
    for after such a reply: a request whose last user message is Hermes's own ``[System: …``
    nudge is judged by the last user message before it, so every try is cut; such a
    continuation's text is ``(continued, part N)`` (N = 2, 3, … for the tries).
``[[surrogate]]``
    Modifier: the text ends with a lone high surrogate (half an emoji,
    ``\ud83d`` as a JSON escape) followed by ``!``.
``[[usage:N]]``
    Modifier: the usage chunk reports ``prompt_tokens: N`` (to push Hermes
    into context compaction without sending that much text).
(no directive)
    ``echo #N: <last user message text>`` where N is the number of
    user-role messages in the request (1 on a new session, 2 on the first
    ``--resume`` ...).  The text is the whole message, directives included.

Auxiliary calls
---------------
Besides the main turn, Hermes 0.19.0 can make side calls that embed the
user's text (directives included):

* session-title generation (``agent/title_generator.py``): system prompt
  "Generate a short, descriptive title ...", user "User: <text> ...",
  ``stream`` not true.  NOT made by ``hermes chat -Q`` (only the interactive
  CLI and the gateway call it) - measured: a ``-Q`` turn sends exactly one
  request per model call, all ``stream: true``;
* context compression (``agent/context_compressor.py``): a single user
  message, no system prompt, not streamed (only near the context limit);
* background memory/skill review (``agent/background_review.py``): a forked
  agent that replays the conversation with the main system prompt and a last
  user message "Review the conversation above ..." (every
  ``memory.nudge_interval`` user turns / ``skills.creation_nudge_interval``
  tool iterations, default 10; ``write_hermes_config`` sets both to 0).

:func:`is_auxiliary` says a request is auxiliary when

1. its first system message starts with one of ``AUX_SYSTEM_PREFIXES``, or
2. its last user message starts with one of ``AUX_USER_PREFIXES``, or
3. ``stream`` is not true, unless its first message is a system message
   containing ``AUX_MAIN_MARKER`` ("Hermes Agent": Hermes' main prompt, in
   case a main turn falls back to non-streaming) or the body carries
   ``"scripted_main": true`` (for hand-written unit-test requests).

Auxiliary calls ignore every directive and immediately get the short plain
answer ``AUX_REPLY`` (``Scripted test conversation``), streamed or not, so a
``[[hang]]`` or ``[[status:500]]`` test never wedges or breaks a side call.
``main_requests()`` returns only streamed, non-auxiliary requests.

Hermes home
-----------
``write_hermes_config`` writes a ``config.yaml`` pointing Hermes at this
server with the settings that keep failures fast; ``hermes_env`` builds a
clean environment for running the CLI.  See their docstrings.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = [
    "AUX_REPLY",
    "DEFAULT_HERMES_BIN",
    "ScriptedModel",
    "hermes_env",
    "parse_tool_directive",
    "write_hermes_config",
]

# The project's own CLI venv (`make setup`), found from this file, never from one checkout's
# absolute path; tests that need the CLI take conftest.hermes_bin(), which also honours
# $HERMES_BIN and PATH and fails (never skips) when no CLI is installed.
DEFAULT_HERMES_BIN = str(Path(__file__).resolve().parent.parent / ".hermes-venv" / "bin" / "hermes")

AUX_REPLY = "Scripted test conversation"

# Start of system prompts used by Hermes auxiliary tasks.
AUX_SYSTEM_PREFIXES = (
    "Generate a short, descriptive title",  # agent/title_generator.py
)
# Start of the last user message of Hermes auxiliary agents.
AUX_USER_PREFIXES = (
    "Review the conversation above",  # agent/background_review.py
)
# Substring of the Hermes main agent system prompt (SOUL.md / prompt_builder).
AUX_MAIN_MARKER = "Hermes Agent"

_STATUS_RE = re.compile(r"\[\[status:(\d{3})\]\]")
_HANG_RE = re.compile(r"\[\[hang\]\]")
_GATE_RE = re.compile(r"\[\[gate:([A-Za-z0-9_-]+)\]\]")
_SLOW_RE = re.compile(r"\[\[slow:(\d+(?:\.\d+)?)(?::(\d+))?\]\]")
_RECALL_RE = re.compile(r"\[\[recall\]\]")
_OFFERED_RE = re.compile(r"\[\[tools-offered\]\]")
_REASONING_RE = re.compile(r"\[\[reasoning\]\]")
_THINK_RE = re.compile(r"\[\[think\]\]")
_EMPTY_RE = re.compile(r"\[\[empty\]\]")
_CUT_RE = re.compile(r"\[\[cut\]\]")
_SURROGATE_RE = re.compile(r"\[\[surrogate\]\]")
_LENGTH_RE = re.compile(r"\[\[length\]\]")
#: How Hermes's own user-role nudges begin (a continuation after a cut reply, …)
NUDGE_PREFIX = "[System: "
_USAGE_RE = re.compile(r"\[\[usage:(\d+)\]\]")
_THEN_HANG_RE = re.compile(r"\[\[then-hang\]\]")
_NARRATE_RE = re.compile(r"\[\[narrate\]\]")

#: What ``[[reasoning]]`` / ``[[think]]`` send as the model's private reasoning.
REASONING_TEXT = "PRIVATE-REASONING: the user wants an answer; think it over step by step first."
_TOOLS_START = "[[tools:"
_NAME_RE = re.compile(r"[A-Za-z0-9_.:\-]+")

_ERROR_TYPES = {
    400: ("invalid_request_error", "bad_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    502: ("server_error", "bad_gateway"),
    503: ("server_error", "overloaded"),
}


# --------------------------------------------------------------------------
# message helpers


def content_text(content: Any) -> str:
    """Text of an OpenAI message ``content`` (string or list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    out.append(part["text"])
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    return [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []


def _last_user_index(msgs: list[dict]) -> int:
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].get("role") == "user":
            return i
    return -1


def _asked_text(msgs: list[dict]) -> str:
    """The last user message that is not one of Hermes's own ``[System: …`` nudges."""
    for m in reversed(msgs):
        if m.get("role") == "user":
            text = content_text(m.get("content"))
            if not text.lstrip().startswith(NUDGE_PREFIX):
                return text
    return ""


def _nudges(msgs: list[dict]) -> int:
    """Hermes's ``[System: …`` nudges after the last real user message."""
    count = 0
    for m in reversed(msgs):
        if m.get("role") == "user":
            if not content_text(m.get("content")).lstrip().startswith(NUDGE_PREFIX):
                return count
            count += 1
    return count


def _last_user_text(body: dict) -> str:
    msgs = _messages(body)
    i = _last_user_index(msgs)
    return content_text(msgs[i].get("content")) if i >= 0 else ""


def _system_text(msgs: list[dict]) -> str:
    for m in msgs:
        if m.get("role") in ("system", "developer"):
            return content_text(m.get("content"))
    return ""


def is_auxiliary(body: dict) -> bool:
    """True for Hermes side calls (title generation etc.); see module doc."""
    msgs = _messages(body)
    system = _system_text(msgs).lstrip()
    if any(system.startswith(p) for p in AUX_SYSTEM_PREFIXES):
        return True
    li = _last_user_index(msgs)
    if li >= 0:
        last = content_text(msgs[li].get("content")).lstrip()
        if any(last.startswith(p) for p in AUX_USER_PREFIXES):
            return True
    if body.get("stream") is True or body.get("scripted_main") is True:
        return False
    first_is_main_system = bool(msgs) and msgs[0].get("role") in ("system", "developer") \
        and AUX_MAIN_MARKER in system
    return not first_is_main_system


def _offered_tools(body: dict) -> list[str]:
    names = []
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            fn: dict = t["function"] if isinstance(t.get("function"), dict) else t
            name = fn.get("name")
            if isinstance(name, str):
                names.append(name)
    return names


def parse_tool_directive(text: str) -> list[tuple[str, dict]] | None:
    """Parse the first ``[[tools:...]]`` directive in *text*.

    Returns a list of ``(name, args)`` or None when there is no (valid)
    directive.
    """
    start = text.find(_TOOLS_START)
    if start < 0:
        return None
    pos = start + len(_TOOLS_START)
    decoder = json.JSONDecoder()
    calls: list[tuple[str, dict]] = []
    n = len(text)

    def skip_ws(p: int) -> int:
        while p < n and text[p].isspace():
            p += 1
        return p

    while True:
        pos = skip_ws(pos)
        m = _NAME_RE.match(text, pos)
        if not m:
            return None
        name = m.group(0)
        pos = skip_ws(m.end())
        args: Any = {}
        if pos < n and text[pos] == "{":
            try:
                args, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            pos = skip_ws(pos)
        calls.append((name, args))
        if text.startswith("]]", pos):
            return calls
        if pos < n and text[pos] == ";":
            pos += 1
            continue
        return None


def _approx_tokens(obj: Any) -> int:
    return max(1, len(json.dumps(obj, ensure_ascii=False)) // 4)


# --------------------------------------------------------------------------
# reply planning


class _Plan:
    """What to answer: an HTTP error, a hang, text, or one tool call."""

    def __init__(self, kind: str, **kw: Any) -> None:
        self.kind = kind  # "error" | "hang" | "text" | "tool_call"
        self.status: int = kw.get("status", 200)
        self.text: str = kw.get("text", "")
        self.tool_name: str = kw.get("tool_name", "")
        self.tool_args: dict = kw.get("tool_args", {})
        self.slow: float = kw.get("slow", 0.0)
        self.pieces: int = kw.get("pieces", 5)          # text pieces of a slow reply
        self.reasoning: str = kw.get("reasoning", "")   # streamed as reasoning_content
        self.cut: bool = kw.get("cut", False)           # drop the stream mid-answer
        self.prompt_tokens: int | None = kw.get("prompt_tokens")
        self.finish: str = kw.get("finish", "stop")      # finish_reason of a text reply


def plan_reply(body: dict, cut_done: set | None = None) -> _Plan:
    """The reply to one chat-completions request (see the module doc for directives).

    ``cut_done`` (shared per server) remembers the ``[[cut]]`` messages already cut once.
    """
    plan = _plan_reply(body)
    if is_auxiliary(body) or plan.kind != "text":
        return plan
    msgs = _messages(body)
    li = _last_user_index(msgs)
    user_text = content_text(msgs[li].get("content")) if li >= 0 else ""
    if _EMPTY_RE.search(user_text):
        plan.text = ""
    if _SURROGATE_RE.search(user_text):
        plan.text += "\ud83d!"
    if _THINK_RE.search(user_text):
        plan.text = f"<think>{REASONING_TEXT}</think>" + plan.text
    if _REASONING_RE.search(user_text):
        plan.reasoning = REASONING_TEXT
    m = _USAGE_RE.search(user_text)
    if m:
        plan.prompt_tokens = int(m.group(1))
    if _LENGTH_RE.search(_asked_text(msgs)):
        plan.finish = "length"
        if user_text.lstrip().startswith(NUDGE_PREFIX):      # Hermes asks for the rest
            plan.text = f"(continued, part {_nudges(msgs) + 1})"
    if _CUT_RE.search(user_text) and cut_done is not None and user_text not in cut_done:
        cut_done.add(user_text)
        plan.cut = True
    return plan


def _plan_reply(body: dict) -> _Plan:
    if is_auxiliary(body):
        return _Plan("text", text=AUX_REPLY)
    msgs = _messages(body)
    li = _last_user_index(msgs)
    user_text = content_text(msgs[li].get("content")) if li >= 0 else ""
    slow_m = _SLOW_RE.search(user_text)
    slow = float(slow_m.group(1)) if slow_m else 0.0
    pieces = int(slow_m.group(2)) if slow_m and slow_m.group(2) else 5

    m = _STATUS_RE.search(user_text)
    if m:
        return _Plan("error", status=int(m.group(1)))
    if _HANG_RE.search(user_text):
        return _Plan("hang")
    calls = parse_tool_directive(user_text)
    if calls is not None:
        after = msgs[li + 1 :] if li >= 0 else []
        results = [content_text(x.get("content")) for x in after if x.get("role") == "tool"]
        step = len(results)
        if step < len(calls):
            name, args = calls[step]
            if name not in _offered_tools(body):
                return _Plan("text", text=f"tool not offered: {name}", slow=slow, pieces=pieces)
            return _Plan("tool_call", tool_name=name, tool_args=args,
                         text=f"calling {name}." if _NARRATE_RE.search(user_text) else "")
        if _THEN_HANG_RE.search(user_text):
            return _Plan("hang")
        return _Plan("text", text="tools done: " + " || ".join(results), slow=slow, pieces=pieces)
    if _OFFERED_RE.search(user_text):
        names = sorted(_offered_tools(body))
        return _Plan("text", text=",".join(names) if names else "(none)", slow=slow, pieces=pieces)
    user_msgs = [content_text(x.get("content")) for x in msgs if x.get("role") == "user"]
    if _RECALL_RE.search(user_text):
        return _Plan("text", text=" | ".join(user_msgs[:-1]), slow=slow, pieces=pieces)
    return _Plan("text", text=f"echo #{len(user_msgs)}: {user_text}", slow=slow, pieces=pieces)


# --------------------------------------------------------------------------
# HTTP server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    scripted: ScriptedModel


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # keep test output quiet

    # -- plumbing ---------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        # each SSE frame is its own small write: without TCP_NODELAY most wait ~40 ms for the
        # client's delayed ACK (Nagle), which real providers do not add
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.scripted._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.scripted._track(self.connection, False)

    def _send_json(self, status: int, obj: Any, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error_json(self, status: int, message: str, headers: dict | None = None) -> None:
        fallback = ("server_error" if status >= 500 else "invalid_request_error", None)
        etype, code = _ERROR_TYPES.get(status, fallback)
        self._send_json(
            status,
            {"error": {"message": message, "type": etype, "param": None, "code": code}},
            headers,
        )

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _client_gone_or_stopped(self, timeout: float) -> bool:
        """Wait up to *timeout*; True if stop() was called or the peer closed."""
        stop = self.server.scripted._stop_event
        if stop.is_set():
            return True
        try:      # poll, not select: select() fails for descriptors >= 1024 (a process with
            poller = select.poll()       # many sockets, e.g. bench/stream_fanout.py's clients)
            poller.register(self.connection, select.POLLIN)
            r = poller.poll(timeout * 1000)
        except (OSError, ValueError):
            return True
        if r:
            try:
                if self.connection.recv(1, socket.MSG_PEEK) == b"":
                    return True
            except OSError:
                return True
            # unexpected pipelined data: just keep waiting without spinning
            time.sleep(min(timeout, 0.05))
        return stop.is_set()

    # -- routes -----------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        sm = self.server.scripted
        if path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [sm._model_obj()]})
        elif path.startswith("/v1/models/") and path[len("/v1/models/"):] == sm.model_id:
            self._send_json(200, sm._model_obj())
        else:
            self._send_error_json(404, f"not found: GET {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        raw = self._read_body()
        if path != "/v1/chat/completions":
            self._send_error_json(404, f"not found: POST {path}")
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body is not an object")
        except ValueError as e:
            self._send_error_json(400, f"invalid JSON body: {e}")
            return
        sm = self.server.scripted
        sm._record(body, dict(self.headers.items()))
        plan = (sm.planner or plan_reply)(body, sm._cut_done)
        gate = None if is_auxiliary(body) else _GATE_RE.search(_last_user_text(body))
        if gate is not None:
            opened = sm._gate(gate.group(1))
            while not opened.is_set():
                if self._client_gone_or_stopped(0.2):
                    self.close_connection = True
                    return
        try:
            if plan.kind == "error":
                headers = {"Retry-After": "1"} if plan.status == 429 else None
                self._send_error_json(plan.status, f"scripted HTTP {plan.status} error", headers)
            elif plan.kind == "hang":
                self.close_connection = True
                while not self._client_gone_or_stopped(0.2):
                    pass
            elif body.get("stream") is True:
                self._stream(body, plan)
            else:
                self._complete(body, plan)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True

    # -- replies ----------------------------------------------------------

    def _usage(self, body: dict, completion: Any, prompt_tokens: int | None = None) -> dict:
        p = prompt_tokens or _approx_tokens(body.get("messages"))
        c = _approx_tokens(completion)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _complete(self, body: dict, plan: _Plan) -> None:
        if plan.slow and self._client_gone_or_stopped(plan.slow):
            self.close_connection = True
            return
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if plan.kind == "tool_call":
            message["content"] = plan.text or None
            message["tool_calls"] = [
                {
                    "id": _call_id(),
                    "type": "function",
                    "function": {"name": plan.tool_name, "arguments": json.dumps(plan.tool_args)},
                }
            ]
            finish = "tool_calls"
        else:
            message["content"] = plan.text
            if plan.reasoning:
                message["reasoning_content"] = plan.reasoning
            finish = plan.finish
        self._send_json(
            200,
            {
                "id": "chatcmpl-" + uuid.uuid4().hex[:24],
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.server.scripted.model_id,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": None}],
                "usage": self._usage(body, message, plan.prompt_tokens),
            },
        )

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, body: dict, plan: _Plan) -> None:
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = self.server.scripted.model_id

        def frame(delta: dict | None, finish: str | None = None,
                  usage: dict | None = None) -> bytes:
            obj: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [] if delta is None else [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
            }
            if usage is not None:
                obj["usage"] = usage
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._write_chunk(frame({"role": "assistant", "content": ""}))

        if plan.kind == "tool_call":
            args = json.dumps(plan.tool_args)
            for piece in _split(plan.text, 2) if plan.text else []:
                self._write_chunk(frame({"content": piece}))
            self._write_chunk(frame({"tool_calls": [{
                "index": 0, "id": _call_id(), "type": "function",
                "function": {"name": plan.tool_name, "arguments": ""},
            }]}))
            step = max(1, (len(args) + 2) // 3)
            for i in range(0, len(args), step):
                self._write_chunk(frame({"tool_calls": [{
                    "index": 0, "function": {"arguments": args[i:i + step]},
                }]}))
            self._write_chunk(frame({}, "tool_calls"))
            completion: Any = {"tool": plan.tool_name, "arguments": args}
        else:
            for piece in _split(plan.reasoning, 3) if plan.reasoning else []:
                self._write_chunk(frame({"reasoning_content": piece}))
            pieces = _split(plan.text, plan.pieces if plan.slow else 3)
            delay = plan.slow / len(pieces) if plan.slow else 0.0
            for i, piece in enumerate(pieces):
                if delay and self._client_gone_or_stopped(delay):
                    self.close_connection = True
                    return
                if plan.cut and i == len(pieces) // 2:
                    self.close_connection = True   # no finish_reason, no [DONE]
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._write_chunk(frame({"content": piece}))
            self._write_chunk(frame({}, plan.finish))
            completion = plan.text

        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            self._write_chunk(frame(None, usage=self._usage(body, completion, plan.prompt_tokens)))
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")  # terminating zero-length chunk


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _split(text: str, n: int) -> list[str]:
    if not text:
        return [""]
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)]


class ScriptedModel:
    """A scripted OpenAI-compatible chat-completions server (see module doc).

    ``planner(body, cut_done) -> _Plan`` replaces :func:`plan_reply` (the directives) as the
    way a request's reply is chosen; the demo's wraps it (:func:`hermes_service.installed.demo`)."""

    def __init__(self, model_id: str = "scripted-model", planner=None) -> None:
        self.model_id = model_id
        self.planner = planner
        self.base_url = ""
        self.requests: list[dict] = []  # every chat-completions body, in arrival order
        self.request_headers: list[dict] = []  # headers of each, same order
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._cut_done: set[str] = set()
        self._gates: dict[str, threading.Event] = {}

    # public ---------------------------------------------------------------

    def start(self) -> ScriptedModel:
        if self._server is not None:
            return self
        self._stop_event.clear()
        srv = _Server(("127.0.0.1", 0), _Handler)
        srv.scripted = self
        self._server = srv
        port = srv.server_address[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self._thread = threading.Thread(
            target=srv.serve_forever, kwargs={"poll_interval": 0.1},
            name=f"scripted-model-{port}", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; hanging/slow requests are released (connection dropped)."""
        srv = self._server
        if srv is None:
            return
        self._stop_event.set()
        srv.shutdown()
        srv.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # idle keep-alive connections and anything still open
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
        self._server = None
        self._thread = None

    def main_requests(self) -> list[dict]:
        """Main-turn requests only: ``stream: true`` and not auxiliary."""
        with self._lock:
            reqs = list(self.requests)
        return [r for r in reqs if r.get("stream") is True and not is_auxiliary(r)]

    def aux_requests(self) -> list[dict]:
        with self._lock:
            reqs = list(self.requests)
        return [r for r in reqs if is_auxiliary(r)]

    def requests_with(self, marker: str) -> list[dict]:
        """Main requests whose last user message contains *marker*."""
        out = []
        for r in self.main_requests():
            msgs = _messages(r)
            i = _last_user_index(msgs)
            if i >= 0 and marker in content_text(msgs[i].get("content")):
                out.append(r)
        return out

    def release(self, name: str) -> None:
        """Let the replies held by ``[[gate:NAME]]`` go (now and from now on)."""
        self._gate(name).set()

    def _gate(self, name: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(name, threading.Event())

    def __enter__(self) -> ScriptedModel:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # internal ---------------------------------------------------------------

    def _record(self, body: dict, headers: dict) -> None:
        with self._lock:
            self.requests.append(body)
            self.request_headers.append(headers)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def _model_obj(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": 1700000000,
                "owned_by": "scripted"}


# --------------------------------------------------------------------------
# Hermes home helpers


def _deep_merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v
    return base


_PLAIN_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def _yaml(obj: Any, indent: int = 0) -> str:
    """Tiny YAML emitter: block mappings/lists, JSON-quoted scalars."""
    pad = "  " * indent
    lines = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = str(k) if _PLAIN_KEY_RE.match(str(k)) else json.dumps(str(k))
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{key}:\n{_yaml(v, indent + 1)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(v)}")
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}-\n{_yaml(v, indent + 1)}")
            else:
                lines.append(f"{pad}- {_scalar(v)}")
    return "\n".join(lines)


def _scalar(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return json.dumps(v)  # strings double-quoted, true/false/null, numbers


def hermes_config(base_url: str, model: str, api_key_env: str, extra: dict | None = None) -> dict:
    """The config dict written by :func:`write_hermes_config` (*extra* deep-merged).

    Key names as read by hermes-agent 0.19.0 (src paths in site-packages):

    * ``model.provider: custom`` + ``base_url`` + ``default`` + ``api_key``
      (``${VAR}`` expanded from the environment); ``model.context_length``
      skips probing the endpoint for its context size.
    * ``agent.api_max_retries`` (agent/agent_init.py; default 3, min 1 = a
      single attempt): with 1, a 401/429/500 fails after one request, in the
      time of a normal turn (~6-7 s) instead of ~15 s.
    * ``security.tirith_enabled: false`` (else it tries to download a scanner
      and warns on STDOUT), ``security.allow_lazy_installs: false``.
    * ``agent.environment_probe: false`` (agent/agent_init.py, tools/env_probe.py): no
      five python/pip subprocesses at start (~1.1 s of CPU) for a system-prompt line.
    * ``memory.nudge_interval: 0`` and ``skills.creation_nudge_interval: 0``
      (agent/agent_init.py): no background memory/skill review agent (an
      extra model conversation every 10 user turns / 10 tool iterations).

    Not set here, documented for callers (pass via *extra*):

    * ``providers.custom.request_timeout_seconds: N`` (hermes_cli/timeouts.py,
      provider id ``custom``): connect/read timeout of each model call.
      Without it a local base_url gets 1800 s (``HERMES_API_TIMEOUT``) and the
      stream stale detector 900 s (``agent.local_stream_stale_timeout`` /
      ``HERMES_LOCAL_STREAM_STALE_TIMEOUT``), so a hung model keeps the CLI
      waiting ~15 min - i.e. a hang stays a hang until you kill it.  With
      N=3 a hung model failed after 17 s (timeout, one hard-coded "primary
      recovery" retry ~4 s later, timeout again), rc 1.
    * ``providers.custom.stale_timeout_seconds`` likewise for the stale
      detector.
    """
    cfg: dict[str, Any] = {
        "model": {
            "provider": "custom",
            "base_url": base_url,
            "default": model,
            "api_key": "${%s}" % api_key_env,
            "context_length": 128000,
        },
        "agent": {"api_max_retries": 1, "environment_probe": False},
        "memory": {"nudge_interval": 0},
        "skills": {"creation_nudge_interval": 0},
        "security": {"tirith_enabled": False, "allow_lazy_installs": False},
    }
    if extra:
        _deep_merge(cfg, extra)
    return cfg


def write_hermes_config(
    home: Path | str,
    base_url: str,
    model: str,
    api_key_env: str,
    extra: dict | None = None,
) -> Path:
    """Write ``<home>/config.yaml`` pointing Hermes at *base_url*.

    *extra* is deep-merged into the config (e.g. ``{"plugins": {"enabled":
    ["x"]}}``).  Returns the path written.
    """
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.yaml"
    text = _yaml(hermes_config(base_url, model, api_key_env, extra))
    path.write_text(text + "\n", encoding="utf-8")
    return path


def hermes_env(
    home: Path | str,
    api_key_env: str,
    api_key: str = "sk-scripted-test-key",
    extra: dict | None = None,
) -> dict[str, str]:
    """A clean environment for running ``hermes`` against the scripted model.

    PATH, HOME=HERMES_HOME=*home*, LANG=C.UTF-8, the API key variable, and
    ``HERMES_STREAM_RETRIES=0`` (agent/chat_completion_helpers.py, default 2:
    mid-stream reconnect attempts).  *extra* is added last.
    """
    home = str(home)
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": home,
        "HERMES_HOME": home,
        "LANG": "C.UTF-8",
        api_key_env: api_key,
        "HERMES_STREAM_RETRIES": "0",  # no mid-stream reconnect attempts
    }
    if extra:
        env.update(extra)
    return env

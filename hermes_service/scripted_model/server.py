"""The scripted model's HTTP server (docs/testing.md §The scripted model): ``GET /v1/models``,
``POST /v1/chat/completions`` answered as its plan says, streamed as ``chat.completion.chunk``
frames or as one JSON object, and the requests it saw."""
from __future__ import annotations

import json
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..embedded_http import OpenConnections, stop_server
from .plans import GATE_RE, Plan, plan_reply
from .requests import (
    approx_tokens,
    content_text,
    is_auxiliary,
    last_user_index,
    last_user_text,
    messages,
)

ERROR_TYPES = {
    400: ("invalid_request_error", "bad_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    502: ("server_error", "bad_gateway"),
    503: ("server_error", "overloaded"),
}

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
        etype, code = ERROR_TYPES.get(status, fallback)
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
        gate = None if is_auxiliary(body) else GATE_RE.search(last_user_text(body))
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
        p = prompt_tokens or approx_tokens(body.get("messages"))
        c = approx_tokens(completion)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _complete(self, body: dict, plan: Plan) -> None:
        if plan.slow and self._client_gone_or_stopped(plan.slow):
            self.close_connection = True
            return
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if plan.kind == "tool_call":
            message["content"] = plan.text or None
            message["tool_calls"] = [
                {
                    "id": call_id(),
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
                **({} if plan.no_usage else {
                    "usage": self._usage(body, message, plan.prompt_tokens)}),
            },
        )

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, body: dict, plan: Plan) -> None:
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
            for piece in split_text(plan.text, 2) if plan.text else []:
                self._write_chunk(frame({"content": piece}))
            self._write_chunk(frame({"tool_calls": [{
                "index": 0, "id": call_id(), "type": "function",
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
            for piece in split_text(plan.reasoning, 3) if plan.reasoning else []:
                self._write_chunk(frame({"reasoning_content": piece}))
            pieces = split_text(plan.text, plan.pieces if plan.slow else 3)
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
        if isinstance(opts, dict) and opts.get("include_usage") and not plan.no_usage:
            self._write_chunk(frame(None, usage=self._usage(body, completion, plan.prompt_tokens)))
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")  # terminating zero-length chunk


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def split_text(text: str, n: int) -> list[str]:
    if not text:
        return [""]
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)]


class ScriptedModel:
    """A scripted OpenAI-compatible chat-completions server (see module doc).

    ``planner(body, cut_done) -> Plan`` replaces :func:`plan_reply` (the directives) as the
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
        self._conns = OpenConnections()
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
        # idle keep-alive connections and anything still open are cut
        stop_server(srv, self._thread, self._conns)
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
            msgs = messages(r)
            i = last_user_index(msgs)
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
        self._conns.track(conn, add)

    def _model_obj(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": 1700000000,
                "owned_by": "scripted"}

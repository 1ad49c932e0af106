"""The reference kernel: the embedded page store (:class:`~..page_sqlite.SQLitePageStore`)
behind the kernel adapter's protocol, over HTTP (``main.py mnote serve-kernel``) and as a
command (``main.py mnote kernel-command``). docs/mnote-tools.md §The reference kernel.

It is the executable description of the protocol for mnote's kernel, and what the tests, the
benchmark and a demo point ``mnote.page_store`` at:

* **HTTP**: ``POST`` (any path) of a §2 envelope → HTTP 200 with the §3 envelope of every
  call it executed (``ok`` true or false); a body that is not JSON → 400, a body over
  :data:`MAX_REQUEST_BYTES` → 413, another method → 405 (each a §3 failure envelope,
  ``mnote_tool_bad_request``); a missing or wrong ``Authorization: Bearer <credential>`` →
  401 ``mnote_tool_unauthorized`` (when it was started with a credential);
* **command**: one §2 envelope on standard input → its §3 envelope on standard output, exit
  status 0 (also for ``ok: false``); 3 only when the page store cannot be opened.

The tool executor checks what the contract asks of a kernel: the envelope and the tool's
schema, the ``capabilityScope``, membership and page rights, idempotency, dryRun and the
audit row of every write (``audit.commandId``).
"""
from __future__ import annotations

import hmac
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ..page_sqlite import SQLitePageStore
from ..tools import ToolExecutor, echo_fields

#: the largest request body read (bytes)
MAX_REQUEST_BYTES = 2 * 1024 * 1024
BAD_REQUEST = "mnote_tool_bad_request"


def failure(code: str, message: str, request: Any = None) -> dict:
    """A §3 failure envelope echoing what ``request`` names."""
    echo = echo_fields(request)
    return {"ok": False, "toolName": echo["toolName"], "toolCallId": echo["toolCallId"],
            "traceId": echo["traceId"], "result": None,
            "audit": {"effect": "none", "commandId": None, "workspaceId": echo["workspaceId"],
                      "documentId": echo["documentId"]},
            "error": {"code": code, "message": message}}


def _json(value: dict) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


class ReferenceKernel:
    """One page store file answering envelopes (``credential``: what HTTP callers must send
    as ``Authorization: Bearer``; None accepts any caller)."""

    def __init__(self, store_path: str | Path, credential: str | None = None):
        self.store = SQLitePageStore(store_path)
        self.executor = ToolExecutor(self.store)
        self.credential = credential

    def answer(self, body: bytes) -> tuple[int, dict]:
        """(HTTP status, §3 envelope) of one request body."""
        try:
            request = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return 400, failure(BAD_REQUEST, "/: the body is not a JSON envelope")
        return 200, self.executor.invoke(request)

    def __call__(self, environ: dict, start_response: Callable) -> list[bytes]:
        """The WSGI application."""
        status, out = self._http(environ)
        text = {200: "200 OK", 400: "400 Bad Request", 401: "401 Unauthorized",
                405: "405 Method Not Allowed", 413: "413 Payload Too Large"}[status]
        data = _json(out)
        start_response(text, [("Content-Type", "application/json; charset=utf-8"),
                              ("Content-Length", str(len(data)))])
        return [data]

    def _http(self, environ: dict) -> tuple[int, dict]:
        if self.credential is not None:
            scheme, _, token = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode("utf-8", "surrogatepass"),
                    self.credential.encode("utf-8", "surrogatepass")):
                return 401, failure("mnote_tool_unauthorized",
                                    "a valid kernel credential is required")
        if environ.get("REQUEST_METHOD") != "POST":
            return 405, failure(BAD_REQUEST, "POST a tool envelope")
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_REQUEST_BYTES:
            return 413, failure(BAD_REQUEST, f"the body must be at most {MAX_REQUEST_BYTES} bytes")
        return self.answer(environ["wsgi.input"].read(length))

    def serve(self, host: str, port: int, on_ready: Callable[[str], None],
              threads: int = 4) -> None:
        """Serve HTTP on ``host:port`` (0: a free port) until interrupted; ``on_ready(url)``
        once listening."""
        from waitress.server import create_server
        server = create_server(self, host=host, port=port, threads=threads, ident="mnote-kernel",
                               max_request_body_size=MAX_REQUEST_BYTES)
        where = f"[{host}]" if ":" in host else host
        on_ready(f"http://{where}:{server.effective_port}/")
        try:
            server.run()
        finally:
            server.close()
            self.store.close()

    def command(self, stdin: BinaryIO, stdout: BinaryIO) -> int:
        """Answer the one envelope on ``stdin``; exit status 0."""
        body = stdin.read(MAX_REQUEST_BYTES + 1)
        if len(body) > MAX_REQUEST_BYTES:
            out = failure(BAD_REQUEST, f"the envelope must be at most {MAX_REQUEST_BYTES} bytes")
        else:
            out = self.answer(body)[1]
        stdout.write(_json(out) + b"\n")
        stdout.flush()
        self.store.close()
        return 0


def run_command(store_path: str | Path) -> int:
    """``kernel-command``: this process's standard input and output."""
    return ReferenceKernel(store_path).command(sys.stdin.buffer, sys.stdout.buffer)

"""Kernels for the kernel adapter's tests (docs/mnote-tools.md §The kernel adapter): real
loopback HTTP servers and real commands around the reference kernel, never mocks.

* :func:`seed` — a page store file with ``ws_1``/``doc_1`` (``user_1`` owner, ``user_a``
  editor, ``user_v`` viewer) and ``ws_2``/``doc_secret`` (``user_z`` only; :data:`SECRETS` in it).
* :class:`KernelServer` — a threaded HTTP/1.1 server on 127.0.0.1 answering with a
  :class:`BrokenKernel` (the reference kernel, ``flaw`` breaking one rule of the contract
  for the conformance check's tests), except for a call whose ``fault`` names a transport
  fault (:data:`FAULTS`). ``fault`` is a function of the request envelope (and the attempt
  number for its toolCallId); by default a ``fault:NAME`` marker in the call's arguments
  (so a model's tool call chooses it). Every request is kept in :attr:`KernelServer.requests`.
* ``python tests/support/kernels.py DB [FLAW]`` — the same as a command (``fault:NAME``
  markers: :data:`COMMAND_FAULTS`).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hermes_service.mnote.blocks import block_hash
from hermes_service.mnote.kernel.reference import ReferenceKernel
from hermes_service.mnote.page_sqlite import SQLitePageStore

SECRETS = ("TOP-SECRET-TITLE", "SECRET-BODY-TEXT")
HUGE_BYTES = 10 * 1024 * 1024
#: transport faults of the HTTP kernel
FAULTS = ("html", "garbage", "truncated", "wrong_call", "hang", "drip", "huge", "huge_chunked",
          "endless_chunked", "length_not_ascii",
          "reset", "reset_once", "status_503", "status_503_once", "unauthorized", "html_500",
          "ok_false")
#: faults of the command kernel
COMMAND_FAULTS = ("exit_3", "huge", "hang", "hang_child", "garbage", "wrong_call", "signal_once",
                  "env", "stdin_ignored")
_MARKER = re.compile(r"fault:([a-z0-9_]+)(?::(mnote_tool_[a-z_]+))?")


def seed(path) -> Path:
    store = SQLitePageStore(path)
    try:
        store.add_workspace("ws_1")
        store.add_member("ws_1", "user_1", "owner")
        store.add_member("ws_1", "user_a", "editor")
        store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                           "blocks": [{"id": "b1", "type": "paragraph", "text": "第一段"}]})
        store.add_workspace("ws_2")
        store.add_member("ws_2", "user_z", "owner")
        store.import_page({"documentId": "doc_secret", "workspaceId": "ws_2", "title": SECRETS[0],
                           "blocks": [{"type": "paragraph", "text": SECRETS[1]}]})
        store.add_member("ws_1", "user_v", "viewer")
    finally:
        store.close()
    return Path(path)


def marker(envelope) -> tuple[str | None, str | None]:
    """(fault name, error code) of a ``fault:NAME[:code]`` marker in the call's arguments."""
    found = _MARKER.search(json.dumps(envelope.get("args") if isinstance(envelope, dict) else "",
                                      ensure_ascii=False))
    return (found.group(1), found.group(2)) if found else (None, None)


class BrokenKernel(ReferenceKernel):
    """The reference kernel with one rule broken (``flaw``; None: none):

    * ``wrong_call_id`` — every answer names another toolCallId;
    * ``no_command_id`` — writes answer without ``audit.commandId``;
    * ``dry_run_writes`` — a dryRun write is written, and answered like a dry run;
    * ``no_idempotency`` — the idempotencyKey is ignored (every call writes);
    * ``conflict_replays`` — a key reused with other arguments replays the first answer;
    * ``leaks_title`` — a denied page.get's message names the page's title;
    * ``accepts_unknown_option`` — page.update_options with an unknown option answers ok;
    * ``accepts_malformed`` — an envelope without toolCallId, with ``args`` not an object or
      a ``dryRun`` not a boolean is answered ok;
    * ``answers_anyone`` — no credential is asked for;
    * ``no_block_hash`` — page.get's blocks come without their ``hash``;
    * ``answers_twice`` — a suggestion accepted or rejected already is answered ok again;
    * ``stale_batch_applies`` — a batch refused as a conflict is applied anyway, without its
      ``expectHash`` checks (a partial, non-atomic kernel);
    * ``bad_suggestion_list`` — mnote.suggestion.list answers ``suggestions`` that are not a
      list of objects.
    """

    def __init__(self, store_path, credential=None, flaw=None):
        super().__init__(store_path, None if flaw == "answers_anyone" else credential)
        self.flaw = flaw
        self._first: dict = {}

    def answer(self, body: bytes):
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict) or not self.flaw:
            return super().answer(body)
        flaw, args = self.flaw, request.get("args") if isinstance(request.get("args"), dict) else {}
        if flaw == "no_idempotency":
            request.pop("idempotencyKey", None)
            request["idempotencyKey"] = f"fresh_{time.monotonic_ns()}"
        dry = request.get("dryRun") is True
        if flaw == "dry_run_writes" and dry:
            request["dryRun"] = False
        if flaw == "accepts_unknown_option" and request.get("toolName") == "mnote.page.update_options":
            return 200, self._ok(request, {"commandName": "page.layout.updateOptions"}, "write")
        status, out = super().answer(json.dumps(request).encode())
        code = (out.get("error") or {}).get("code")
        if flaw == "wrong_call_id":
            out["toolCallId"] = f"{out.get('toolCallId')}_other"
        elif flaw == "no_command_id" and out["audit"]["effect"] == "write":
            out["audit"]["commandId"] = None
        elif flaw == "dry_run_writes" and dry and out["ok"]:
            out["result"], out["audit"]["effect"], out["audit"]["commandId"] = \
                {"dryRun": True, "diff": []}, "dry_run", None
        elif flaw == "conflict_replays":
            key = request.get("idempotencyKey")
            if code == "mnote_tool_idempotency_conflict" and key in self._first:
                out = {**self._first[key], "toolCallId": request.get("toolCallId")}
            elif out["ok"] and key:
                self._first.setdefault(key, out)
        elif flaw == "leaks_title" and code == "mnote_tool_permission_denied":
            try:
                out["error"]["message"] += f"（{self.store.export_page(request['documentId'])['title']}）"
            except Exception:   # noqa: BLE001 - an unknown page: nothing to leak
                pass
        elif flaw == "no_block_hash" and out["ok"] and request.get("toolName") == "mnote.page.get":
            for block in out["result"].get("blocks", []):
                block.pop("hash", None)
        elif flaw == "bad_suggestion_list" and request.get("toolName") == "mnote.suggestion.list":
            out["result"] = {"suggestions": [1, "x", None]}
        elif flaw == "answers_twice" and code == "mnote_tool_suggestion_closed":
            out = self._ok(request, {"status": "accepted"}, "write")
        elif flaw == "stale_batch_applies" and code == "mnote_tool_conflict" and \
                request.get("toolName") == "mnote.block.batch":
            fresh = {op.get("blockId"): h for b in self.store.export_page(request["documentId"])
                     ["blocks"] for op in args.get("ops", []) for h in [block_hash(b)]
                     if op.get("blockId") == b["id"]}
            ops = [{**op, "expectHash": fresh[op["blockId"]]} if op.get("blockId") in fresh
                   else op for op in args.get("ops", []) if op.get("blockId") in fresh
                   or op.get("op") == "insert"]
            page = self.store.export_page(request["documentId"])["revision"]
            retry = {**request, "args": {"ops": ops, "baseRevision": page}}
            if ops:
                status, out = super().answer(json.dumps(retry).encode())
        elif flaw == "accepts_malformed" and code == "mnote_tool_bad_request" and (
                "toolCallId" not in request or not isinstance(request.get("args"), dict)
                or not isinstance(request.get("dryRun", False), bool)):
            out = self._ok(request, {}, "read")
        del args
        return status, out

    @staticmethod
    def _ok(request, result, effect):
        return {"ok": True, "toolName": request.get("toolName"),
                "toolCallId": request.get("toolCallId"), "traceId": request.get("traceId"),
                "result": result, "audit": {"effect": effect, "commandId":
                                            "cmd_fake" if effect == "write" else None},
                "error": None}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):          # quiet
        pass

    def setup(self):
        super().setup()        # headers and body go in two writes: no Nagle wait between them
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self):
        server: KernelServer = self.server.owner
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        attempt = server.record(dict(self.headers), request, self.client_address)
        fault = server.fault(request, attempt) if isinstance(request, dict) else None
        if fault and not fault.startswith("ok_false"):
            return self._fault(fault, request)
        if server.upstream:
            status, data = self._relay(server.upstream, body)
            if not (fault and fault.startswith("ok_false")):
                return self._send(status, data)
            out = json.loads(data)
        else:
            if server.kernel.credential is not None:
                token = self.headers.get("Authorization", "")
                if token != f"Bearer {server.kernel.credential}":
                    return self._send(401, {"ok": False, "error": {
                        "code": "mnote_tool_unauthorized", "message": "no"}})
            status, out = server.kernel.answer(body)
        if fault and fault.startswith("ok_false"):
            code = marker(request)[1] or "mnote_tool_conflict"
            out = {**out, "ok": False, "result": None,
                   "audit": {**out["audit"], "effect": "none", "commandId": None},
                   "error": {"code": code, "message": f"kernel says {code}"}}
        self._send(status, out)

    def _relay(self, upstream, body):
        import urllib.error
        import urllib.request
        headers = {k: v for k, v in self.headers.items() if k in ("Authorization", "Content-Type")}
        request = urllib.request.Request(upstream, data=body, headers=headers, method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=60) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def _send(self, status, obj, content_type="application/json"):
        data = obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fault(self, fault, request):
        stop = self.server.owner.stopping
        if fault in ("reset", "reset_once"):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            self.close_connection = True
            return
        if fault in ("status_503", "status_503_once"):
            return self._send(503, b"<html>busy</html>", "text/html")
        if fault == "unauthorized":
            return self._send(401, b"go away", "text/plain")
        if fault == "html":
            return self._send(200, b"<html><body>SECRET-HTML-BODY</body></html>", "text/html")
        if fault == "html_500":
            return self._send(500, b"<html>Internal Server Error SECRET-HTML-BODY</html>", "text/html")
        if fault == "garbage":
            return self._send(200, b'{"ok": tru SECRET-GARBAGE')
        if fault == "wrong_call":
            return self._send(200, {"ok": True, "toolName": request.get("toolName"),
                                    "toolCallId": "call_someone_else",
                                    "traceId": request.get("traceId"), "result": {},
                                    "audit": {"effect": "read", "commandId": None}})
        if fault == "truncated":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "5000")
            self.end_headers()
            self.wfile.write(b'{"ok": true, "toolName": "SECRET-TRUNCATED')
            self.close_connection = True
            return
        if fault == "hang":
            stop.wait(120)
            self.close_connection = True
            return
        if fault == "drip":
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            while not stop.wait(0.2):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    break
            self.close_connection = True
            return
        if fault == "endless_chunked":     # chunks until the reader hangs up
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"x" * 65536
            try:
                while not stop.is_set():
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                pass
            self.close_connection = True
            return
        if fault == "length_not_ascii":    # a length str.isdigit() takes and int() refuses
            self.send_response(200)
            self.send_header("Content-Length", "\u00b2")   # one byte, 0xb2
            self.end_headers()
            self.wfile.write(b'{"ok": tru SECRET-GARBAGE')
            self.close_connection = True
            return
        if fault in ("huge", "huge_chunked"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if fault == "huge":
                self.send_header("Content-Length", str(HUGE_BYTES))
            else:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"x" * 65536
            try:
                for _ in range(HUGE_BYTES // len(chunk)):
                    if fault == "huge":
                        self.wfile.write(chunk)
                    else:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if fault == "huge_chunked":
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass
            self.close_connection = True
            return
        raise AssertionError(f"unknown fault {fault}")


class KernelServer:
    """A loopback HTTP kernel (module doc). ``with KernelServer(db) as k: k.url``."""

    def __init__(self, store_path=None, *, credential=None, flaw=None, fault=None, tls=None,
                 upstream=None):
        """``tls``: (certificate file, key file) to serve https; ``upstream``: the URL of
        another kernel (e.g. ``main.py mnote serve-kernel``) that answers every call without a
        fault, as received (``store_path`` then unused)."""
        self.upstream = upstream
        self.kernel = BrokenKernel(store_path, credential, flaw) if upstream is None else None
        self.fault = fault or self._marker_fault
        self.requests: list[tuple[dict, object]] = []
        self._attempts: dict = {}
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.clients: set = set()
        if tls:
            import ssl
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}/hermes-tool"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @staticmethod
    def _marker_fault(request, attempt):
        name, _ = marker(request)
        if name in ("reset_once", "status_503_once"):
            return name if attempt == 1 else None
        return name

    def record(self, headers: dict, request, client=None) -> int:
        """Keep a request (and the client address it came from: :attr:`clients`); its attempt
        number for its toolCallId (1, 2, …)."""
        call = request.get("toolCallId") if isinstance(request, dict) else None
        with self._lock:
            self.requests.append((headers, request))
            self.clients.add(client)
            self._attempts[call] = self._attempts.get(call, 0) + 1
            return self._attempts[call]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.kernel is not None:
            self.kernel.store.close()


# -- the command kernel -------------------------------------------------------------------
def command_main(db: str, flaw: str | None = None) -> int:
    """One envelope on stdin, one answer on stdout; ``fault:NAME`` markers (COMMAND_FAULTS).
    ``flaw`` ``--via-main``: a call without a fault goes to ``main.py mnote kernel-command``
    (the reference kernel's own command form), its answer relayed as it is."""
    body = sys.stdin.buffer.read()
    try:
        request = json.loads(body)
    except ValueError:
        request = None
    fault, _ = marker(request)
    if flaw == "--via-main" and (fault is None or fault not in COMMAND_FAULTS):
        root = Path(__file__).resolve().parents[2]
        done = subprocess.run([sys.executable, str(root / "main.py"), "mnote", "--db", db,
                               "kernel-command"], input=body, capture_output=True, cwd=root)
        sys.stdout.buffer.write(done.stdout)
        return done.returncode
    if fault == "stdin_ignored" or fault is None or fault not in COMMAND_FAULTS:
        kernel = BrokenKernel(db, None, flaw)
        out = kernel.answer(body)[1]
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        return 0
    if fault == "exit_3":       # and shows its credential (the log must not)
        sys.stderr.write(f"kernel broke: SECRET-STDERR {os.environ.get('KERNEL_CRED')}\n")
        return 3
    if fault == "huge":
        chunk = "x" * 65536
        for _ in range(HUGE_BYTES // len(chunk)):
            sys.stdout.write(chunk)
        return 0
    pids = Path(db).with_suffix(".pids")
    if fault == "hang":
        with pids.open("a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(600)
    if fault == "hang_child":   # answers, exits, and leaves a child holding the pipes
        child = subprocess.Popen(["sleep", "600"])
        with pids.open("a") as fh:
            fh.write(f"{child.pid}\n")
        kernel = BrokenKernel(db, None, None)
        sys.stdout.write(json.dumps(kernel.answer(body)[1]) + "\n")
        return 0
    if fault == "garbage":
        sys.stdout.write("<html>SECRET-HTML-BODY</html>")
        return 0
    if fault == "wrong_call":
        kernel = BrokenKernel(db, None, None)
        out = kernel.answer(json.dumps({**request, "toolCallId": "call_other"}).encode())[1]
        sys.stdout.write(json.dumps(out))
        return 0
    if fault == "signal_once":
        flag = Path(db).with_suffix(f".signalled.{request.get('toolCallId')}")
        if not flag.exists():
            flag.write_text("1")
            os.kill(os.getpid(), signal.SIGKILL)
        kernel = BrokenKernel(db, None, None)
        sys.stdout.write(json.dumps(kernel.answer(body)[1]))
        return 0
    if fault == "env":         # the environment's names in an ok:false message
        names = " ".join(sorted(os.environ))
        sys.stdout.write(json.dumps({
            "ok": False, "toolName": request["toolName"], "toolCallId": request["toolCallId"],
            "traceId": request["traceId"], "error": {"code": "mnote_tool_conflict",
                                                     "message": f"env: {names}"}}))
        return 0
    raise AssertionError(fault)


def command_argv(db, flaw: str | None = None) -> list[str]:
    """The argv of the command kernel on page store ``db``."""
    return [sys.executable, str(Path(__file__).resolve()), str(db), *([flaw] if flaw else [])]


if __name__ == "__main__":
    sys.exit(command_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))

"""What a flood of costly pass-through bodies does to everyone else, with every body checked in
the service's interpreter (the old way: ``--inline``) and with costly ones checked in worker
processes (hermes_service/model_proxy/body_check.py), side by side in one run; and what
checking a normal Hermes request costs.

One process holds what the service holds: the pass-through, a ``/health`` endpoint (a plain
HTTP server: what every other request of the service needs is the GIL) and the scripted
model. For each mode, ``--threads`` attackers (another process) send ``[[],[],…]`` bodies of the 4 MiB cap as
fast as they are answered for ``--seconds``, while a probe times ``GET /health`` every 50 ms
and another user's small chat request through the pass-through every 200 ms. Prints p50/p95
of both, idle and under each flood, and how many flood bodies were answered.

    .venv/bin/python bench/model_body.py [--seconds S] [--threads N]

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.model_proxy import limits  # noqa: E402
from hermes_service.model_proxy.body_check import BodyChecker  # noqa: E402
from hermes_service.model_proxy.policy import Policy  # noqa: E402
from hermes_service.model_proxy.proxy import ModelProxy  # noqa: E402
from hermes_service.scripted_model import ScriptedModel  # noqa: E402

KEY_ENV = "BENCH_MODEL_BODY_KEY"
CAP = 4 * 1024 * 1024


class Health(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def hermes_request(tools: int = 30, turns: int = 6) -> bytes:
    """A request shaped like Hermes 0.19.0's (~56 KB: its tool schemas, a few turns)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description":
              "a parameter of this tool, described at the length Hermes's are " * 3}
              for i in range(6)}, "required": ["p0"]}
    tool_list = [{"type": "function", "function": {"name": f"tool_{i}", "description":
                  "What this tool does, at the length of Hermes's descriptions. " * 4,
                  "parameters": schema}} for i in range(tools)]
    messages = [{"role": "system", "content": "You are Hermes. " * 200}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i} " * 20},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}",
                      "type": "function", "function": {"name": "tool_1",
                                                       "arguments": json.dumps({"p0": "x"})}}]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "name": "tool_1",
                      "content": json.dumps({"output": "line, of; output\n" * 40})},
                     {"role": "assistant", "content": f"answer {i} " * 30}]
    return json.dumps({"model": "scripted-model", "messages": messages, "tools": tool_list,
                       "max_tokens": 65536, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def check_cost(n: int = 300) -> None:
    body = hermes_request()
    policy = Policy(frozenset({"scripted-model"}), CAP)
    checker = BodyChecker()
    ctype = "application/json"

    def timed(fn):
        for _ in range(20):
            fn()
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t) * 1000)
        return statistics.median(xs)

    plain = timed(lambda: json.dumps(json.loads(body), ensure_ascii=False,
                                     separators=(",", ":")).encode())
    inline = timed(lambda: checker.prepare(policy, f"u{time.perf_counter()}", body, ctype))
    saved = limits.INLINE_BYTES
    limits.INLINE_BYTES = 0
    try:
        worker = timed(lambda: checker.prepare(policy, f"u{time.perf_counter()}", body, ctype))
    finally:
        limits.INLINE_BYTES = saved
        checker.close()
    print(f"a Hermes request of {len(body) // 1000} KB: parse + re-encode only {plain:.2f} ms; "
          f"checked inline {inline:.2f} ms (+{inline - plain:.2f}); in a worker {worker:.2f} ms "
          "(median)")


def flood_body() -> bytes:
    head, tail = b'{"model":"scripted-model","messages":[', b"]}"
    n = (CAP - len(head) - len(tail)) // 3
    return head + b",".join([b"[]"] * n) + tail


def flood(port: int, credential: str, seconds: float, threads: int) -> None:
    """The attacker (its own process, as a sandboxed agent is): ``threads`` connections
    sending the flood body as fast as they are answered; prints how many were answered."""
    body = flood_body()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer "
           + credential.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
           b"%d\r\n\r\n" % len(body)) + body
    answered = [0]
    end = time.monotonic() + seconds

    def one():
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                    s.sendall(req)
                    if s.recv(64):
                        answered[0] += 1
            except OSError:
                time.sleep(0.01)
    ts = [threading.Thread(target=one) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(answered[0])


def run(proxy: ModelProxy, health_port: int, seconds: float, threads: int) -> dict:
    stop = threading.Event()
    attacker = subprocess.Popen(
        [sys.executable, __file__, "--flood", str(proxy.port), proxy.issue("attacker"),
         str(seconds), str(threads)], stdout=subprocess.PIPE, text=True) if threads else None
    health, chat = [], []

    def probe_health():
        conn = http.client.HTTPConnection("127.0.0.1", health_port, timeout=60)
        while not stop.is_set():
            t = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            health.append((time.perf_counter() - t) * 1000)
            time.sleep(0.05)

    victim = proxy.issue("victim")
    small = json.dumps({"model": "scripted-model", "messages": [
        {"role": "user", "content": "hello"}]}).encode()

    def probe_chat():
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
        while not stop.is_set():
            t = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", small,
                         {"Authorization": f"Bearer {victim}",
                          "Content-Type": "application/json"})
            conn.getresponse().read()
            chat.append((time.perf_counter() - t) * 1000)
            time.sleep(0.2)

    probes = [threading.Thread(target=probe_health, daemon=True),
              threading.Thread(target=probe_chat, daemon=True)]
    for t in probes:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in probes:
        t.join(30)
    answered = int(attacker.communicate(timeout=120)[0] or 0) if attacker else 0
    return {"health": health, "chat": chat, "answered": answered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--flood", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood:
        port, cred, seconds, threads = args.flood
        flood(int(port), cred, float(seconds), int(threads))
        return
    check_cost()
    os.environ[KEY_ENV] = "k"
    model = ScriptedModel("scripted-model").start()
    health = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for mode in ("idle", "flood, inline (before)", "flood, workers (now)"):
            proxy = ModelProxy(model.base_url, KEY_ENV, Path(tmp) / f"{len(rows)}.db",
                               models={"scripted-model"}).start()
            saved = (limits.INLINE_BYTES, limits.INLINE_VALUES, limits.PARSE_BYTES_PER_SECOND)
            if "inline" in mode:
                limits.INLINE_BYTES = limits.INLINE_VALUES = 1 << 40
                limits.PARSE_BYTES_PER_SECOND = 1 << 40
            try:
                got = run(proxy, health.server_address[1], args.seconds,
                          0 if mode == "idle" else args.threads)
            finally:
                limits.INLINE_BYTES, limits.INLINE_VALUES, limits.PARSE_BYTES_PER_SECOND = saved
                proxy.stop()
            rows.append((mode, got))
    health.shutdown()
    model.stop()
    print(f"{'':26s} {'/health p50':>11s} {'p95':>8s} {'chat p50':>9s} {'p95':>8s} "
          f"{'flood bodies answered':>22s}")
    for mode, got in rows:
        print(f"{mode:26s} {pct(got['health'], .5):9.1f}ms {pct(got['health'], .95):6.1f}ms "
              f"{pct(got['chat'], .5):7.1f}ms {pct(got['chat'], .95):6.1f}ms "
              f"{got['answered']:22d}")


if __name__ == "__main__":
    main()

"""Model pass-through endpoint overhead: N streamed chat completions straight to the scripted
model vs the same through hermes_service.model_proxy, side by side in one run.

Each side keeps one HTTP/1.1 keep-alive connection (as Hermes's httpx client does); the
requests alternate direct / proxied so both see the same machine load. Per request it times
the first body chunk (the first SSE event, from sending the request) and the whole answer
(to ``data: [DONE]`` and the end of the body). Prints median and p90 of each side and the
difference in ms.

    .venv/bin/python bench/model_proxy.py [--requests N] [--pieces K]

``--pieces``: content pieces per answer (the scripted model's ``[[slow:S:K]]`` spreads them
over ``--slow`` seconds; 0 s by default: back to back). Figures, not asserts: the machines
are shared and noisy.

The scripted model sets ``TCP_NODELAY`` on its sockets (with Nagle's algorithm, RFC 896,
and the client's delayed ACK most of its answers would wait ~40 ms for their second piece,
drowning the difference); the proxy sets it on its own (http.client does on the upstream side).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.model_proxy.proxy import ModelProxy  # noqa: E402
from hermes_service.scripted_model import ScriptedModel  # noqa: E402

KEY_ENV = "BENCH_MODEL_PROXY_KEY"


def one(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict):
    t0 = time.perf_counter()
    conn.request("POST", path, body, headers)
    resp = conn.getresponse()
    first = None
    tail = b""
    while True:
        data = resp.read1(65536)
        if not data:
            break
        if first is None:
            first = time.perf_counter() - t0
        tail = (tail + data)[-64:]
    resp.read()
    total = time.perf_counter() - t0
    assert resp.status == 200 and tail.endswith(b"data: [DONE]\n\n"), (resp.status, tail)
    return first * 1000, total * 1000


def p90(xs):
    return statistics.quantiles(xs, n=10)[-1] if len(xs) >= 2 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--pieces", type=int, default=20)
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tools", type=int, default=200,
                    help="tool schemas in each request (200: ~53 KB, a Hermes turn's size)")
    args = ap.parse_args()

    os.environ[KEY_ENV] = "sk-bench"
    model = ScriptedModel("scripted-model").start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-model-proxy-"))
    proxy = ModelProxy(model.base_url, KEY_ENV, tmp / "model_usage.db",
                       models={"scripted-model"}).start()
    cred = proxy.issue("bench")
    try:
        mport = int(model.base_url.rsplit(":", 1)[1].split("/")[0])
        direct = http.client.HTTPConnection("127.0.0.1", mport, timeout=30)
        proxied = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        text = "bench " + "x" * 400
        # a real Hermes turn sends ~53 KB (its tool schemas): checked and re-encoded each time
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 200,
                                                   "parameters": {"type": "object"}}}
                 for i in range(args.tools)]
        slow = f" [[slow:{args.slow}:{args.pieces}]]" if args.slow else ""
        body = json.dumps({"model": "scripted-model", "stream": True,
                           "stream_options": {"include_usage": True}, "tools": tools,
                           "messages": [{"role": "user", "content": text + slow}]}).encode()
        hd = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
        hp = {"Content-Type": "application/json", "Authorization": f"Bearer {cred}"}
        res = {"direct": ([], []), "proxy": ([], [])}
        for i in range(args.warmup + args.requests):
            for name, conn, h in (("direct", direct, hd), ("proxy", proxied, hp)) if i % 2 \
                    else (("proxy", proxied, hp), ("direct", direct, hd)):
                first, total = one(conn, "/v1/chat/completions", body, h)
                if i >= args.warmup:
                    res[name][0].append(first)
                    res[name][1].append(total)
    finally:
        proxy.stop()
        model.stop()

    print(f"{args.requests} streamed chat completions per side (one keep-alive connection "
          f"each, alternating; {os.cpu_count()} CPUs; slow={args.slow:g} s)")
    print(f"{'':22}{'direct':>16}{'proxy':>16}{'difference':>16}")
    for idx, label in ((0, "first chunk"), (1, "whole response")):
        d, p = res["direct"][idx], res["proxy"][idx]
        for stat, fn in (("median", statistics.median), ("p90", p90)):
            a, b = fn(d), fn(p)
            print(f"{label + ' ' + stat:22}{a:13.2f} ms{b:13.2f} ms{b - a:+13.2f} ms")


if __name__ == "__main__":
    main()

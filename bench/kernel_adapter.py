"""A tool call's added latency through mnote's kernel (docs/mnote-tools.md §The kernel
adapter): ``mnote.page_store.kind`` http and command against the embedded store, side by side
in one run (docs/benchmarks.md §Kernel adapter).

The same tool executor the tool endpoint uses runs every call, in this process, against:

* ``embedded`` — the SQLite page store (``data/mnote.db``), directly;
* ``http`` — ``main.py mnote serve-kernel`` (the reference kernel: the same store behind
  waitress, a credential required) over loopback, through the adapter's pooled connections;
* ``command`` — ``main.py mnote kernel-command``, one process per call (a Python start-up
  and the package's imports: what a Python kernel command costs, not the adapter);
* ``command (minimal)`` — a ``python3 -S`` command answering a fixed valid envelope from the
  standard library alone: the adapter's own cost of a command (spawn, pipes, group kill).

Calls alternate between the sides call by call (page.get, then an ai-note write), so every
side sees the same machine load. Per tool and side: the median and the 10th-90th
percentiles in ms, and the median's difference to embedded (the added latency).

    .venv/bin/python bench/kernel_adapter.py [--calls N]    (or: make bench-kernel)

``--calls`` N (default 200): calls per tool and side (~2 minutes: the command side's Python
start-up dominates). Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.mnote.kernel.adapter import KernelBackend  # noqa: E402
from hermes_service.mnote.kernel.command import CommandKernel  # noqa: E402
from hermes_service.mnote.kernel.over_http import HttpKernel  # noqa: E402
from hermes_service.mnote.page_sqlite import SQLitePageStore  # noqa: E402
from hermes_service.mnote.tools import ToolExecutor  # noqa: E402
from support.kernels import seed  # noqa: E402

CRED_ENV = "BENCH_KERNEL_CREDENTIAL"
TOOLS = ("mnote.page.get", "mnote.artifact.create_ai_note")
#: the minimal command kernel: echoes a valid answer for any call (no store)
MINIMAL = r"""
import json, sys
r = json.load(sys.stdin)
w = r["toolName"] != "mnote.page.get"
print(json.dumps({"ok": True, "toolName": r["toolName"], "toolCallId": r["toolCallId"],
 "traceId": r["traceId"], "result": {"documentId": r["documentId"], "title": "t", "blocks": []},
 "audit": {"effect": "write" if w else "read", "commandId": "cmd_%s" % r["toolCallId"] if w else None}}))
"""


def envelope(tool: str, i: int) -> dict:
    return {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1", "actorId": "user_a",
            "sessionId": "bench", "runId": "run_bench", "toolCallId": f"call_{i}",
            "traceId": "trace_bench", "capabilityScope": ["page.read", "artifact.write"],
            "args": {} if tool == "mnote.page.get" else {"content": f"AI 笔记 {i}"},
            **({} if tool == "mnote.page.get" else {"idempotencyKey": f"k_{i}_{time.time_ns()}",
                                                    "dryRun": False})}


def serve_kernel(db: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "mnote", "--db", str(db),
                             "serve-kernel", "--port", "0", "--credential-env", CRED_ENV],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " at " not in line:
        proc.kill()
        sys.exit(f"serve-kernel did not start: {line}")
    return proc, line.split(" at ")[1].split()[0]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per tool and side")
    n = ap.parse_args().calls
    os.environ[CRED_ENV] = "bench-kernel-credential-0123456789"
    tmp = Path(tempfile.mkdtemp(prefix="hermes-bench-kernel-"))
    proc, url = serve_kernel(seed(tmp / "kernel-http.db"))
    sides = {
        "embedded": ToolExecutor(SQLitePageStore(seed(tmp / "embedded.db"))),
        "http": ToolExecutor(backend=KernelBackend(HttpKernel(url, credential_env=CRED_ENV), 15)),
        "command": ToolExecutor(backend=KernelBackend(CommandKernel(
            [sys.executable, str(ROOT / "main.py"), "mnote", "--db",
             str(seed(tmp / "kernel-command.db")), "kernel-command"]), 15)),
        "command (minimal)": ToolExecutor(backend=KernelBackend(CommandKernel(
            [sys.executable, "-S", "-c", MINIMAL]), 15)),
    }
    times = {(side, tool): [] for side in sides for tool in TOOLS}
    started = time.monotonic()
    try:
        for i in range(n):
            for tool in TOOLS:
                order = list(sides)
                if i % 2:
                    order.reverse()
                for side in order:
                    t0 = time.perf_counter()
                    out = sides[side].invoke(envelope(tool, i))
                    times[(side, tool)].append((time.perf_counter() - t0) * 1000)
                    if not out["ok"]:
                        sys.exit(f"{side} {tool}: {out['error']}")
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"kernel adapter: {n} calls per tool and side, alternating; {time.monotonic() - started:.0f} s "
          f"on {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"{'':20}" + "".join(f"{tool:>40}" for tool in TOOLS))
    for side in sides:
        cells = []
        for tool in TOOLS:
            v, base = times[(side, tool)], statistics.median(times[("embedded", tool)])
            med = statistics.median(v)
            added = "" if side == "embedded" else f"  +{med - base:.2f}"
            cells.append(f"{med:8.2f} ms ({pct(v, 0.1):.2f}-{pct(v, 0.9):.2f}){added}")
        print(f"{side:20}" + "".join(f"{c:>40}" for c in cells))


if __name__ == "__main__":
    main()

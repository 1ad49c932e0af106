"""Event-stream fan-out (docs/mnote-client.md §Event-stream fan-out): N Server-Sent Events
subscribers on one live run of one service.

For each N (default 100, 500, 1000), a fresh real service (``main.py``: waitress, free port)
with the settings docs/mnote-client.md §Event-stream fan-out recommends for N subscribers::

    mnote.max_event_streams = N
    service.threads          = N + 24    (check-config needs >= N + 2*max_concurrent_runs
                                          + max_waiting_requests + 4 = N + 12)
    service.connection_limit = threads + 176   (check-config needs >= threads + 100)

and one live run: a ``[[hang]]`` turn of the real hermes CLI against the scripted model (the
model never answers, so the run lives until it is aborted). Then:

1. **subscribe**: N clients connect at once (asyncio in this process, one socket each, plain
   HTTP/1.1) → how many stream (200 and the run's ``run.started`` frame), and when the last did;
2. **idle**: the service's CPU while the N streams wait (keepalives every 15 s only; the
   /health probe pauses meanwhile), compared with the service before any stream; its RSS and
   threads with them open;
3. **one event to all**: ``POST …/abort`` → ``abort.started`` is emitted during that request;
   time from sending the POST to each subscriber receiving the frame (p50, max);
   ``run.cancelled`` then ends every stream;
4. **disconnect**: N clients on a second live run close their sockets at once → time until
   the service's ``hermes_service_event_streams_open`` gauge reads 0 (slots free);
5. **a streamed answer**: N clients on a run whose answer streams as 240 ``message.delta``
   events over 6 s (``[[slow:6:240]]``; the ACP runner streams token by token, so the bench's
   service runs ``hermes.runner: acp``) → the service's CPU during the answer, how long the
   last subscriber waited for the terminal event after the first got it, and every delta
   delivered (frames per subscriber).

Throughout, ``GET /health`` on a fresh connection every 20 ms (like a load balancer's check):
p50 / p99 / max, overall and while the event is delivered.

    .venv/bin/python bench/stream_fanout.py [--subscribers 100 500 1000] [--idle 5]
    make bench-streams

Figures, not asserts. The clients, the scripted model and the service share this machine's
cores; the load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import re
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
P = "/api/hermes/client"
HEADERS = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "bench_fanout"}
MARKERS = (b": stream open", b'"run.started"', b'"abort.started"', b'"run.cancelled"',
           b'"run.completed"')
STREAMED = "[[slow:6:240]] " + "word " * 400      # 240 message.delta events over ~6 s
PHASE_LIMIT = 120.0          # no phase waits longer than this


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def status(pid: int) -> dict[str, int]:
    """VmRSS (bytes) and Threads of a process."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss"] = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            out["threads"] = int(line.split()[1])
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


class HealthProbe(threading.Thread):
    """GET /health on a new connection every ``interval`` s; keeps (sent_at, seconds, status)."""

    def __init__(self, port: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.port, self.interval = port, interval
        self.samples: list[tuple[float, float, int]] = []
        self.stop = threading.Event()
        self.paused = threading.Event()      # set: no probe (while idle CPU is measured)

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            if self.paused.is_set():
                continue
            t = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("GET", "/health")
                code = conn.getresponse().status
                conn.close()
            except OSError:
                code = 0
            self.samples.append((t, time.monotonic() - t, code))

    def between(self, start: float, end: float) -> list[float]:
        return [s for t, s, _ in self.samples if start <= t <= end]


@dataclass
class Subscriber:
    status: int | None = None
    seen: dict = field(default_factory=dict)      # marker -> monotonic time first seen
    closed_at: float | None = None
    writer: asyncio.StreamWriter | None = None
    deltas: int = 0          # message.delta frames received


class Clients:
    """N event-stream clients on one asyncio loop in a thread of this process."""

    def __init__(self, port: int):
        self.port = port
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def call(self, coro, timeout: float = PHASE_LIMIT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _one(self, path: str, sub: Subscriber) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            sub.status = 0
            return
        sub.writer = writer
        head = "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())
        tail = b""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                now = time.monotonic()
                sub.deltas += (tail[-32:] + data).count(b'"message.delta"') - \
                    tail[-32:].count(b'"message.delta"')
                tail = tail[-64:] + data
                if sub.status is None and b"\r\n" in tail:
                    m = re.match(rb"HTTP/1\.[01] (\d{3})", tail)
                    sub.status = int(m.group(1)) if m else 0
                for marker in MARKERS:
                    if marker not in sub.seen and marker in tail:
                        sub.seen[marker] = now
        except (OSError, asyncio.CancelledError):
            pass
        sub.closed_at = time.monotonic()

    def open(self, path: str, n: int) -> tuple[list[Subscriber], list]:
        subs = [Subscriber() for _ in range(n)]

        async def start():
            return [asyncio.ensure_future(self._one(path, s)) for s in subs]
        return subs, self.call(start())

    def close_all(self, subs: list[Subscriber]) -> None:
        async def close():
            for s in subs:
                if s.writer is not None:
                    s.writer.close()
        self.call(close())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def wait_until(pred, limit: float = PHASE_LIMIT, step: float = 0.05) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def streams_open(svc: ServiceProcess) -> int:
    text = svc.get("/metrics", timeout=30).text
    m = re.search(r"^hermes_service_event_streams_open ([0-9.e+]+)$", text, re.M)
    return int(float(m.group(1))) if m else -1


def hang_run(svc: ServiceProcess, model: ScriptedModel, marker: str) -> str:
    res = svc.post(f"{P}/runs", headers=HEADERS, json={
        "workspaceId": "ws", "documentId": "doc", "sessionId": f"s_{marker}",
        "message": f"[[hang]] {marker}"})
    assert res.status_code == 200, res.text
    # the CLI is waiting on the model: run.started was emitted long ago
    assert wait_until(lambda: model.requests_with(marker)), "the CLI never reached the model"
    return res.json()["runId"]


def settings(n: int) -> dict:
    threads = n + 24
    return {"mnote": {"max_event_streams": n, "max_streams_per_actor": n},
            "service": {"threads": threads, "connection_limit": threads + 176}}


BENCH_ONLY = {"hermes": {"runner": "acp"}, "mnote": {"runner": "acp"}}     # phase 5 needs an answer that streams


def one(n: int, model: ScriptedModel, idle: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"hermes-fanout-{n}-"))
    cfg = deep_merge(deep_merge(base_config(tmp, model.base_url), settings(n)), BENCH_ONLY)
    svc = ServiceProcess(tmp, cfg).start()
    pid = svc.proc.pid
    clients = Clients(svc.port)
    probe = HealthProbe(svc.port)
    out: dict = {"n": n, **{k: v for sec in settings(n).values() for k, v in sec.items()}}
    try:
        # warm-up: the user's ACP process starts with its first turn
        warm = hang_run(svc, model, f"fanout-{n}-warm")
        svc.post(f"{P}/runs/{warm}/abort", headers=HEADERS, json={})
        time.sleep(2)
        out["idle_status"] = status(pid)
        c0, i0 = cpu_seconds(pid), time.monotonic()
        time.sleep(idle)
        out["base_cpu_ms_per_s"] = (cpu_seconds(pid) - c0) / (time.monotonic() - i0) * 1000
        probe.start()
        c0, i0 = cpu_seconds(pid), time.monotonic()
        time.sleep(idle)                                  # /health with no subscriber
        out["health_base"] = probe.between(i0, time.monotonic())
        out["cpu_per_health_base_ms"] = (cpu_seconds(pid) - c0) / len(out["health_base"]) * 1000

        # 1. subscribe
        run1 = hang_run(svc, model, f"fanout-{n}-a")
        t0 = time.monotonic()
        subs, tasks = clients.open(f"{P}/events/{run1}", n)
        wait_until(lambda: all(s.status not in (None, 200) or b'"run.started"' in s.seen
                               or s.closed_at for s in subs))
        started = [s.seen[b'"run.started"'] for s in subs if b'"run.started"' in s.seen]
        out["streaming"] = len(started)
        out["refused"] = sum(1 for s in subs if s.status not in (None, 200))
        out["all_open_s"] = (max(started) - t0) if started else float("nan")
        out["health_connect"] = probe.between(t0, time.monotonic())

        # 2. idle
        probe.paused.set()
        time.sleep(1)
        out["open_status"] = status(pid)
        c0, i0 = cpu_seconds(pid), time.monotonic()
        time.sleep(idle)
        out["idle_cpu_ms_per_s"] = (cpu_seconds(pid) - c0) / (time.monotonic() - i0) * 1000
        probe.paused.clear()
        c0, i0 = cpu_seconds(pid), time.monotonic()
        time.sleep(idle)                                  # /health with N streams open
        out["cpu_per_health_ms"] = (cpu_seconds(pid) - c0) / len(
            probe.between(i0, time.monotonic())) * 1000

        # 3. one event to all
        c0 = cpu_seconds(pid)
        t_abort = time.monotonic()
        res = svc.post(f"{P}/runs/{run1}/abort", headers=HEADERS, json={})
        out["abort_answer_s"] = time.monotonic() - t_abort
        assert res.status_code == 200, res.text
        wait_until(lambda: all(b'"abort.started"' in s.seen or s.closed_at for s in subs))
        got = [s.seen[b'"abort.started"'] - t_abort for s in subs if b'"abort.started"' in s.seen]
        out["delivered"] = len(got)
        out["deliver_p50_s"], out["deliver_max_s"] = pct(got, 50), max(got, default=float("nan"))
        out["deliver_cpu_s"] = cpu_seconds(pid) - c0
        out["health_deliver"] = probe.between(t_abort, t_abort + max(got, default=0) + 0.05)
        wait_until(lambda: all(s.closed_at for s in subs), limit=30)
        out["ended_with_terminal"] = sum(1 for s in subs if b'"run.cancelled"' in s.seen)

        # 4. disconnect
        run2 = hang_run(svc, model, f"fanout-{n}-b")
        subs2, _ = clients.open(f"{P}/events/{run2}", n)
        wait_until(lambda: all(b'"run.started"' in s.seen or s.closed_at for s in subs2))
        out["streaming_2"] = sum(1 for s in subs2 if b'"run.started"' in s.seen)
        out["gauge_before"] = streams_open(svc)
        t_close = time.monotonic()
        clients.close_all(subs2)
        freed = wait_until(lambda: streams_open(svc) == 0, limit=60, step=0.1)
        out["freed_s"] = time.monotonic() - t_close if freed else float("nan")
        out["status_after"] = status(pid)
        svc.post(f"{P}/runs/{run2}/abort", headers=HEADERS, json={})

        # 5. a streamed answer
        time.sleep(2)
        res = svc.post(f"{P}/runs", headers=HEADERS, json={
            "workspaceId": "ws", "documentId": "doc", "sessionId": f"s_streamed_{n}",
            "message": STREAMED})
        assert res.status_code == 200, res.text
        subs3, _ = clients.open(f"{P}/events/{res.json()['runId']}", n)
        c0, t_run = cpu_seconds(pid), time.monotonic()
        wait_until(lambda: all(s.closed_at for s in subs3), limit=PHASE_LIMIT)
        done = [s.seen[b'"run.completed"'] for s in subs3 if b'"run.completed"' in s.seen]
        out["streamed_completed"] = len(done)
        out["streamed_s"] = (max(done) - t_run) if done else float("nan")
        out["streamed_spread_s"] = (max(done) - min(done)) if done else float("nan")
        out["streamed_cpu_s"] = cpu_seconds(pid) - c0
        out["streamed_deltas"] = sorted(s.deltas for s in subs3)
        out["health_streamed"] = probe.between(t_run, time.monotonic())
        probe.stop.set()
        probe.join()
        out["health_all"] = [s for _, s, _ in probe.samples]
        out["health_failed"] = sum(1 for _, _, code in probe.samples if code != 200)
    finally:
        probe.stop.set()
        clients.stop()
        svc.stop()
    return out


def ms(x: float) -> str:
    return f"{x * 1000:7.1f}"


def report(r: dict) -> None:
    mib = 1024 * 1024
    idle, opened = r["idle_status"], r["open_status"]
    per = (opened["rss"] - idle["rss"]) / max(1, r["streaming"])
    print(f"\n== {r['n']} subscribers (threads {r['threads']}, connection_limit "
          f"{r['connection_limit']}, max_event_streams {r['max_event_streams']})")
    print(f"  streaming:               {r['streaming']} of {r['n']} ({r['refused']} refused), "
          f"all open {r['all_open_s']:.2f} s after the first connect; second run: {r['streaming_2']}")
    print(f"  one event to all:        {r['delivered']} got it; p50 {ms(r['deliver_p50_s'])} ms, "
          f"max {ms(r['deliver_max_s'])} ms after the abort POST (answered in "
          f"{ms(r['abort_answer_s']).strip()} ms); service CPU {r['deliver_cpu_s'] * 1000:.0f} ms; "
          f"{r['ended_with_terminal']} streams ended with run.cancelled")
    for name, key in (("no subscriber", "health_base"), ("while connecting", "health_connect"),
                      ("while delivering", "health_deliver"),
                      ("streamed answer", "health_streamed"), ("whole bench", "health_all")):
        v = r[key]
        print(f"  /health {name:17s} p50 {ms(pct(v, 50))}  p99 {ms(pct(v, 99))}  max "
              f"{ms(max(v, default=float('nan')))} ms  ({len(v)} probes)")
    print(f"  /health failures:        {r['health_failed']}")
    print(f"  service RSS:             {idle['rss'] / mib:.1f} MiB idle ({idle['threads']} threads) -> "
          f"{opened['rss'] / mib:.1f} MiB with them open ({opened['threads']} threads): "
          f"{per / 1024:.0f} KiB per open stream")
    print(f"  service CPU while idle:  {r['idle_cpu_ms_per_s']:.1f} ms per second with the streams "
          f"open ({r['base_cpu_ms_per_s']:.1f} before any; no /health probes meanwhile)")
    print(f"  service CPU per /health: {r['cpu_per_health_ms']:.2f} ms with the streams open "
          f"({r['cpu_per_health_base_ms']:.2f} before any): waitress's loop visits every "
          "connection on each wake-up")
    print(f"  all {r['streaming_2']} clients close: gauge {r['gauge_before']} -> 0 in "
          f"{r['freed_s']:.2f} s; RSS after {r['status_after']['rss'] / mib:.1f} MiB")
    d = r["streamed_deltas"]
    print(f"  streamed answer:         {r['streamed_completed']} got run.completed, the last "
          f"{r['streamed_s']:.1f} s after the POST ({r['streamed_spread_s'] * 1000:.0f} ms after "
          f"the first); message.delta frames per subscriber {d[0]}..{d[-1]}; service CPU "
          f"{r['streamed_cpu_s']:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subscribers", type=int, nargs="+", default=[100, 500, 1000])
    ap.add_argument("--idle", type=float, default=10.0,
                    help="seconds of idle CPU measured (before and with the streams)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(args.subscribers) * 2 + 200
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    model = ScriptedModel().start()
    rows = []
    try:
        for n in args.subscribers:
            r = one(n, model, args.idle)
            report(r)
            rows.append(r)
    finally:
        model.stop()
    print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end")
    print("\n| subscribers | streaming | one event to all (p50 / max) | /health p99 (whole / delivering) "
          "| service RSS idle → open | per stream | threads | idle CPU | slots freed after close "
          "| streamed answer: service CPU, /health p99 | CPU per /health request |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        idle, opened = r["idle_status"], r["open_status"]
        print(f"| {r['n']} | {r['streaming']} | {ms(r['deliver_p50_s']).strip()} / "
              f"{ms(r['deliver_max_s']).strip()} ms | {ms(pct(r['health_all'], 99)).strip()} / "
              f"{ms(pct(r['health_deliver'], 99)).strip()} ms | {idle['rss'] / 2**20:.0f} → "
              f"{opened['rss'] / 2**20:.0f} MiB | "
              f"{(opened['rss'] - idle['rss']) / max(1, r['streaming']) / 1024:.0f} KiB | "
              f"{opened['threads']} | {r['idle_cpu_ms_per_s']:.1f} ms/s | {r['freed_s']:.2f} s | "
              f"{r['streamed_cpu_s']:.1f} s, {ms(pct(r['health_streamed'], 99)).strip()} ms | "
              f"{r['cpu_per_health_base_ms']:.1f} → {r['cpu_per_health_ms']:.1f} ms |")


if __name__ == "__main__":
    main()

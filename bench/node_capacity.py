"""Per-node capacity figures for docs/scaling.md: turns/s per core, RSS per run, event streams.

One real service process (waitress) on this machine, the real ``hermes`` CLI, the scripted
model (hermes_service/scripted_model/, answers at once). Prints:

* CPU seconds per turn (the whole machine's busy CPU over the turns, from /proc/stat: the
  service, the sandboxes and the CLI; a Hermes process in a sandbox is not the service's
  waited-for child, so the service's cutime misses it) and so turns per second per core;
  wall-clock throughput with ``--concurrency`` turns at a time (``hermes.max_concurrent_runs`` = the same);
* peak RSS per CLI run (sampled every 50 ms over each run's process group) and the service's RSS;
* event streams: service RSS and threads with 0 and with ``--streams`` subscribers on one
  live run (a ``[[hang]]`` turn, aborted at the end), and the CPU the service spends while
  they idle (keepalives only).

    .venv/bin/python bench/node_capacity.py [--turns 8] [--concurrency 2] [--streams 24]

Figures, not asserts: the machine is shared; the load average is printed with them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge, hermes_processes  # noqa: E402
from support.sse_client import SSEStream  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(own, waited-for children) CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / TICK, (cutime + cstime) / TICK


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (not idle or waiting for I/O)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


class RssSampler(threading.Thread):
    """Peak RSS per process group of CLI runs of the users' homes under ``data_dir`` (sandboxed
    or not: :func:`support.fixtures.hermes_processes`)."""

    def __init__(self, data_dir: Path):
        super().__init__(daemon=True)
        self.users = data_dir / "users"
        self.peaks: dict[int, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            groups: dict[int, int] = {}
            homes = [str(h) for h in self.users.iterdir()] if self.users.is_dir() else []
            for pid in {pid for home in homes for pid in hermes_processes(home)}:
                try:
                    pgid = os.getpgid(pid)
                except (OSError, ProcessLookupError):
                    continue
                groups[pgid] = groups.get(pgid, 0) + rss_bytes(pid)
            for pgid, rss in groups.items():
                self.peaks[pgid] = max(self.peaks.get(pgid, 0), rss)


def turns(svc: ServiceProcess, n: int, concurrency: int) -> float:
    """n turns, ``concurrency`` users at a time (one session each); returns wall seconds."""
    sids = [svc.post("/api/v1/sessions", json={"user_id": f"bench_{i}"}).json()["session_id"]
            for i in range(concurrency)]
    # warm every home once (the first run in a fresh home does extra set-up)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda sid: svc.post(f"/api/v1/sessions/{sid}/messages",
                                           json={"message": "warm"}), sids))

    def one(i: int) -> None:
        res = svc.post(f"/api/v1/sessions/{sids[i % concurrency]}/messages",
                       json={"message": f"turn {i}"})
        assert res.status_code == 200, res.text
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - t


def streams(svc: ServiceProcess, n: int, idle_seconds: float) -> dict:
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "bench_streams"}
    pid = svc.proc.pid
    before = rss_bytes(pid), threads(pid)
    run = svc.post("/api/hermes/client/runs", headers=h, json={
        "workspaceId": "ws", "documentId": "doc", "sessionId": "s_streams",
        "message": "[[hang]]"}).json()["runId"]
    opened = []
    for _ in range(n):
        s = SSEStream(svc.url + f"/api/hermes/client/events/{run}", h)
        next(iter(s))       # run.started: the stream is live
        opened.append(s)
    time.sleep(1)
    during = rss_bytes(pid), threads(pid)
    own0, _ = cpu_seconds(pid)
    time.sleep(idle_seconds)
    own1, _ = cpu_seconds(pid)
    svc.post(f"/api/hermes/client/runs/{run}/abort", headers=h, json={})
    for s in opened:
        s.close()
    return {"rss_before": before[0], "threads_before": before[1], "rss_during": during[0],
            "threads_during": during[1], "idle_cpu_per_s": (own1 - own0) / idle_seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--streams", type=int, default=24)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle streams measured")
    args = ap.parse_args()
    model = ScriptedModel().start()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-capacity-"))
    cfg = deep_merge(base_config(tmp, model.base_url), {
        "hermes": {"max_concurrent_runs": args.concurrency, "max_waiting_requests": args.concurrency},
        "service": {"threads": args.streams + 4 * args.concurrency + 8, "log_level": "warning"},
        "mnote": {"max_event_streams": args.streams, "max_streams_per_actor": args.streams}})
    svc = ServiceProcess(tmp, cfg).start()
    sampler = RssSampler(svc.data_dir)
    try:
        idle_rss = rss_bytes(svc.proc.pid)
        sampler.start()
        busy0 = machine_busy_seconds()
        t0 = time.perf_counter()
        wall = turns(svc, args.turns, args.concurrency)
        busy1 = machine_busy_seconds()
        sampler.stop.set()
        sampler.join()
        done = args.turns + args.concurrency                      # measured + warm-up turns
        cpu_per_turn = (busy1 - busy0) / done
        peaks = sorted(sampler.peaks.values())
        st = streams(svc, args.streams, args.idle)
        busy_rss = rss_bytes(svc.proc.pid)
    finally:
        svc.stop()
        model.stop()
    mib = 1024 * 1024
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"turns: {args.turns} measured (+{args.concurrency} warm-up), {args.concurrency} at a time")
    print(f"  CPU per turn (whole machine):    {cpu_per_turn:6.2f} s   -> {1 / cpu_per_turn:.2f} turns/s per core")
    print(f"  wall throughput:                 {args.turns / wall:6.2f} turns/s "
          f"({wall / args.turns:.2f} s per turn; whole run {time.perf_counter() - t0:.1f} s)")
    print(f"  CLI runs sampled:                {len(peaks)}")
    if peaks:
        print(f"  peak RSS per CLI run:            median {statistics.median(peaks) / mib:.0f} MiB, "
              f"max {peaks[-1] / mib:.0f} MiB")
    print(f"  service RSS idle / after turns:  {idle_rss / mib:.0f} / {busy_rss / mib:.0f} MiB")
    print(f"event streams: {args.streams} subscribers on one live run")
    per = (st["rss_during"] - st["rss_before"]) / max(1, args.streams)
    print(f"  service RSS before / with them:  {st['rss_before'] / mib:.1f} / {st['rss_during'] / mib:.1f} MiB"
          f" ({per / 1024:.0f} KiB per stream)")
    print(f"  service threads before / with:   {st['threads_before']} / {st['threads_during']}"
          " (waitress threads are started up front; each open stream occupies one)")
    print(f"  service CPU while they idle:     {st['idle_cpu_per_s'] * 1000:.1f} ms per second")


if __name__ == "__main__":
    main()

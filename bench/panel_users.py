"""N panel users at once on one node (docs/scaling.md §Sizing a node): the real service with the
shipped defaults (the limits sized for this machine), the real ``hermes acp``, the scripted model
answering each turn after ``--delay`` seconds (``[[slow:D]]``, as a real provider does).

For each N of ``--users`` (8,16,32 by default), N users each with a panel session (the session
pre-warms the user's ``hermes acp``; the bench waits until all are warm), then one run each,
started at once, each followed on its event stream. Prints, side by side:

* one user's turn alone (a warm run: POST /runs to its terminal event) — the reference;
* N users: wall time until every run ended, and that against one user's turn (target ≤ 2×);
* how the runs ended: completed, refused (with their codes), anything else;
* peak memory during the runs: the service, the warm processes' trees, per warm process
  (RSS and PSS, the memory a process does not share);
* CPU during the runs (the whole machine, from /proc/stat: other work on it counts too;
  the load average is printed) and the service's own;

    .venv/bin/python bench/panel_users.py [--users 8,16,32] [--delay 5]     (make bench-users)

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "bench")]

from hermes_service.sandbox import tree_rss_mb  # noqa: E402
from hermes_service.sandbox.trees import descendants, tree_cpu_seconds  # noqa: E402
from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import API_KEY, ServiceProcess, base_config  # noqa: E402
from support.sse_client import SSEStream  # noqa: E402

P = "/api/hermes/client"
TERMINAL = {"run.completed", "run.failed", "run.cancelled"}


def shipped_limits(tmp: Path, model_url: str) -> dict:
    """The tests' base config with every limit left to the shipped defaults (sized for this
    machine) and the panel on its shipped runner (acp)."""
    cfg = base_config(tmp, model_url)
    del cfg["service"]["threads"]
    for k in ("max_concurrent_runs", "queue_wait_seconds", "timeout_seconds",
              "stall_timeout_seconds"):
        cfg["hermes"].pop(k, None)
    cfg["mnote"] = {}
    return cfg


def headers(user: str) -> dict:
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": user}


def warm_processes(data_dir: Path) -> list[int]:
    """Process group leaders of the live ``hermes acp`` processes."""
    out = []
    for record in (data_dir / "pids").glob("*.json"):
        try:
            if b"acp" in Path(f"/proc/{record.stem}/cmdline").read_bytes():
                out.append(int(record.stem))
        except (OSError, ValueError):
            continue
    return out


def pss_mb(pid: int) -> float:
    """PSS of ``pid`` and its descendants (MiB): its memory, shared pages split by sharers."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue
    return total / 1024


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    words = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(w) for w in words]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prewarm(svc: ServiceProcess, users: list[str], timeout: float = 900) -> float:
    """Create each user's panel session (which pre-warms its process); wait until every one
    is warm. Returns the seconds it took."""
    t = time.monotonic()
    for u in users:
        res = svc.post(f"{P}/sessions", headers=headers(u),
                       json={"workspaceId": "ws", "documentId": f"doc_{u}", "traceId": "t1"})
        assert res.status_code == 200, res.text
    deadline = time.monotonic() + timeout
    while len(warm_processes(svc.data_dir)) < len(users) and time.monotonic() < deadline:
        time.sleep(0.5)
    # warm: started, and its spare session made — their CPU stands still
    before = -1.0
    while time.monotonic() < deadline:
        now = sum(tree_cpu_seconds(p) for p in warm_processes(svc.data_dir))
        if now - before < 0.1:
            break
        before = now
        time.sleep(2)
    return time.monotonic() - t


def one_run(svc: ServiceProcess, user: str, delay: float, out: dict) -> None:
    t = time.monotonic()
    res = svc.post(f"{P}/runs", headers=headers(user), json={
        "workspaceId": "ws", "documentId": f"doc_{user}", "sessionId": f"mnote_doc_{user}_t1",
        "message": f"[[slow:{delay}]] hello from {user}"})
    if res.status_code != 200:
        out[user] = (time.monotonic() - t, f"POST {res.status_code} "
                     f"{res.json().get('code', '') if res.content else ''}".strip())
        return
    end = "no terminal event"
    for _, data in SSEStream(svc.url + f"{P}/events/{res.json()['runId']}", headers(user),
                             timeout=600):
        if data["event"] in TERMINAL:
            end = data["event"] + (f" {data['code']}" if data.get("code") else "")
    out[user] = (time.monotonic() - t, end)


def sampler(svc: ServiceProcess, stop: threading.Event, peak: dict) -> None:
    while not stop.is_set():
        leaders = warm_processes(svc.data_dir)
        trees = sum(tree_rss_mb(p) for p in leaders)
        peak["trees"] = max(peak.get("trees", 0.0), trees)
        peak["service"] = max(peak.get("service", 0.0), rss_mb(svc.proc.pid))
        peak["total"] = max(peak.get("total", 0.0), trees + rss_mb(svc.proc.pid))
        stop.wait(0.5)


def at_once(svc: ServiceProcess, users: list[str], delay: float) -> dict:
    out: dict = {}
    peak: dict = {}
    stop = threading.Event()
    watch = threading.Thread(target=sampler, args=(svc, stop, peak), daemon=True)
    watch.start()
    busy0, total0 = cpu_jiffies()
    svc_cpu0 = proc_cpu(svc.proc.pid)
    leaders = warm_processes(svc.data_dir)
    trees0 = {p: tree_cpu_seconds(p) for p in leaders}
    t = time.monotonic()
    threads = [threading.Thread(target=one_run, args=(svc, u, delay, out)) for u in users]
    for th in threads:
        th.start()
    for th in threads:
        th.join(900)
    wall = time.monotonic() - t
    busy1, total1 = cpu_jiffies()
    trees = sum(tree_cpu_seconds(p) - c for p, c in trees0.items())
    stop.set()
    watch.join(5)
    tick = os.sysconf("SC_CLK_TCK")
    return {"wall": wall, "ends": out, "peak": peak,
            "cpu_machine": (busy1 - busy0) / tick, "cpu_share": (busy1 - busy0) / max(1, total1 - total0),
            "cpu_service": proc_cpu(svc.proc.pid) - svc_cpu0, "cpu_warm": trees}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", default="8,16,32")
    ap.add_argument("--delay", type=float, default=5.0)
    args = ap.parse_args()
    sizes = [int(x) for x in args.users.split(",")]
    model = ScriptedModel("scripted-model").start()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-bench-users-"))
    print(f"load average before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}; {os.cpu_count()} cpus")
    try:
        svc = ServiceProcess(tmp, shipped_limits(tmp, model.base_url)).start()
        try:
            from hermes_service.config.sizing import explain
            from hermes_service.installed import load_config
            for line in explain(load_config(svc.config_path)):
                print(f"  sizing: {line}")
            users: list[str] = []
            warmed = 0.0
            for n in sizes:
                new = [f"user{i}" for i in range(len(users), n)]
                ref_user = f"alone{n}"      # pre-warmed with them: its first run, as theirs
                took = prewarm(svc, [*users, *new, ref_user])
                users += new
                warmed += took
                alone: dict = {}
                one_run(svc, ref_user, args.delay, alone)
                ref = alone[ref_user][0]
                res = at_once(svc, users[:n], args.delay)
                ends: dict[str, int] = {}
                for _, end in res["ends"].values():
                    ends[end] = ends.get(end, 0) + 1
                times = sorted(d for d, _ in res["ends"].values())
                leaders = warm_processes(svc.data_dir)
                rss = [tree_rss_mb(p) for p in leaders]
                pss = [pss_mb(p) for p in leaders]
                print(f"{n} users at once (pre-warm of {len(new)} new users: {took:.0f} s; "
                      f"load {os.getloadavg()[0]:.2f}):")
                print(f"  one user's turn alone:      {ref:6.2f} s")
                print(f"  all {n} ended after:        {res['wall']:6.2f} s  = "
                      f"{res['wall'] / ref:.2f} x one user's turn (target <= 2)")
                print(f"  per run: median {statistics.median(times):.2f} s, "
                      f"max {times[-1]:.2f} s")
                print(f"  ends: {', '.join(f'{k}: {v}' for k, v in sorted(ends.items()))}")
                print(f"  peak RSS: service {res['peak'].get('service', 0):.0f} MiB, "
                      f"warm trees {res['peak'].get('trees', 0):.0f} MiB, "
                      f"together {res['peak'].get('total', 0):.0f} MiB")
                if rss:
                    print(f"  per warm process ({len(rss)}): RSS median "
                          f"{statistics.median(rss):.0f} MiB (max {max(rss):.0f}), PSS median "
                          f"{statistics.median(pss):.0f} MiB")
                print(f"  CPU during the runs: machine {res['cpu_machine']:.1f} s "
                      f"({100 * res['cpu_share']:.0f}% of its capacity), service "
                      f"{res['cpu_service']:.1f} s, warm processes {res['cpu_warm']:.1f} s "
                      f"({res['cpu_warm'] / n:.2f} s per turn)")
        finally:
            svc.stop()
    finally:
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The service's own CPU per warm turn, beside Hermes's own CPU per turn (docs/benchmarks.md
§The service's CPU per warm turn): how much a warm ACP turn costs the service process (its
routes, the pass-through relaying and counting the model's stream, the runner, the run's
events and log lines) against what it costs the user's Hermes process. The node's turns are
bounded by Hermes's CPU; the target is the service adding at most 5 % of it.

One real service process (waitress, ``hermes.runner: acp`` and ``mnote.runner: acp``), real
``hermes acp`` processes in their sandboxes, the scripted model (in this process: its CPU is
neither side's). Per route family: one turn to start the user's warm process (not counted),
then ``--turns`` warm turns one after another; CPU from ``/proc/<pid>/stat`` (utime + stime,
and the reaped children of Hermes's processes: its tool commands) before and after.

    .venv/bin/python bench/warm_turn_cpu.py [--turns 20]

Figures, not asserts: the machine is shared; the load average is printed with them.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge, hermes_processes  # noqa: E402
from support.sse_client import read_all  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
TARGET = 0.05          # the service's CPU per warm turn, as a share of Hermes's


def cpu(pid: int, children: bool = False) -> float:
    """CPU seconds of ``pid`` (and, ``children``, of its reaped children); 0 when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    used = [int(x) for x in fields[11:15]]
    return (sum(used) if children else used[0] + used[1]) / TICK


def hermes_cpu(home: Path) -> float:
    return sum(cpu(pid, children=True) for pid in hermes_processes(str(home)))


def v1_turn(svc, sid: str, n: int) -> None:
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": f"warm turn {n}"})
    assert res.status_code == 200, res.text


def panel_turn(svc, n: int) -> None:
    headers = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "bench_panel"}
    res = svc.post("/api/hermes/client/runs", headers=headers, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_bench",
        "message": f"warm turn {n}"})
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    frames = read_all(svc.url + f"/api/hermes/client/events/{run_id}", headers)
    assert frames[-1][1]["event"] == "run.completed", frames[-1]


IDLE_SECONDS = 5.0


def measure(svc, home: Path, turn, turns: int) -> tuple[float, float, float, float]:
    """(service CPU s, of which its idle work over the same time s, Hermes CPU s, wall s) per
    warm turn over ``turns`` turns. Idle work: what the service spends with nothing to do
    (its timers: the ACP pool's sweeper, the disk watcher, the log writer…), measured over
    :data:`IDLE_SECONDS` with the warm process up and scaled to the turn's wall time."""
    turn(0)                                     # the user's warm process starts here
    time.sleep(1.0)                             # its spare session and title work settle
    i0 = cpu(svc.proc.pid)
    time.sleep(IDLE_SECONDS)
    idle_per_second = (cpu(svc.proc.pid) - i0) / IDLE_SECONDS
    s0, h0, t0 = cpu(svc.proc.pid), hermes_cpu(home), time.monotonic()
    for n in range(1, turns + 1):
        turn(n)
    s1, h1, t1 = cpu(svc.proc.pid), hermes_cpu(home), time.monotonic()
    wall = (t1 - t0) / turns
    return (s1 - s0) / turns, idle_per_second * wall, (h1 - h0) / turns, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20)
    args = ap.parse_args()
    model = ScriptedModel("scripted-model").start()
    with tempfile.TemporaryDirectory(prefix="bench-warm-cpu-") as tmp_name:
        tmp = Path(tmp_name)
        cfg = deep_merge(base_config(tmp, model.base_url),
                         {"hermes": {"runner": "acp", "toolsets": []},
                          "mnote": {"runner": "acp"}, "service": {"log_level": "info"}})
        from hermes_service.mnote.page_sqlite import SQLitePageStore
        store = SQLitePageStore(tmp / "data" / "mnote.db")
        store.add_workspace("ws_1")
        store.add_member("ws_1", "bench_panel", "editor")
        store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "t",
                           "blocks": [{"id": "b1", "type": "paragraph", "text": "p"}]})
        store.close()
        svc = ServiceProcess(tmp, cfg).start()
        try:
            sid = svc.post("/api/v1/sessions", json={"user_id": "bench_v1"}).json()["session_id"]
            users = tmp / "data" / "users"
            rows = [("v1 (ACP)", *measure(svc, users / "bench_v1",
                                          lambda n: v1_turn(svc, sid, n), args.turns)),
                    ("panel (ACP)", *measure(svc, users / "bench_panel",
                                             lambda n: panel_turn(svc, n), args.turns))]
        finally:
            svc.stop()
            model.stop()
    load = os.getloadavg()
    print(f"warm turns: {args.turns} per family, one at a time; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    print(f"{'family':<14}{'service ms/turn':>17}{'(idle part)':>13}{'Hermes ms/turn':>16}"
          f"{'service/Hermes':>16}{'less idle':>11}{'wall ms/turn':>14}")
    for name, service_s, idle_s, hermes_s, wall_s in rows:
        share = service_s / hermes_s if hermes_s > 0 else float("inf")
        busy = (service_s - idle_s) / hermes_s if hermes_s > 0 else float("inf")
        mark = "" if share <= TARGET else f"   (over the {TARGET:.0%} target)"
        print(f"{name:<14}{service_s * 1000:>17.1f}{idle_s * 1000:>13.1f}{hermes_s * 1000:>16.1f}"
              f"{share:>16.1%}{busy:>11.1%}{wall_s * 1000:>14.0f}{mark}")


if __name__ == "__main__":
    main()

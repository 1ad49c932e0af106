"""The two runners side by side (docs/runners.md): one run, the same scripted model.

Prints, with medians over ``--turns`` samples:

* bare ``hermes chat`` turn (no service) — the reference;
* CLI-runner service turn (v1 message on a continuing session);
* ACP warm turn (v1 message on a continuing session of a warm user);
* ACP cold first turn (a new user: process start, ``initialize``, session, prompt);
* time from ``POST /runs`` to the first ``message.delta`` on a warm user (mnote, existing
  session; the model streams 5 pieces 50 ms apart, ``[[slow:0.25]]``);
* abort to ``run.cancelled`` on the ACP runner (the model is mid-stream);
* RSS of a warm ACP process (MB);

and the ratios against the runner targets (docs/benchmarks.md): warm ≤ 0.1 × bare, first delta ≤ 300 ms,
cold ≤ 1.5 × bare, RSS ≤ 150 MB.

    .venv/bin/python bench/runners.py [--turns N]      (or: make bench)

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "bench")]

from turn_overhead import bare_turns  # noqa: E402

from hermes_service.sandbox import tree_rss_mb  # noqa: E402
from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge  # noqa: E402
from support.sse_client import SSEStream  # noqa: E402

P = "/api/hermes/client"


def v1_turns(svc: ServiceProcess, user: str, n: int, warmup: int = 0) -> list[float]:
    sid = svc.post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]
    times = []
    for i in range(warmup + n):
        t = time.perf_counter()
        res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": f"turn {i}"})
        if i >= warmup:
            times.append(time.perf_counter() - t)
        assert res.status_code == 200, res.text
    return times


def cold_first_turns(svc: ServiceProcess, n: int) -> list[float]:
    times = []
    for i in range(n):
        sid = svc.post("/api/v1/sessions", json={"user_id": f"cold{i}"}).json()["session_id"]
        t = time.perf_counter()
        res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "first"})
        times.append(time.perf_counter() - t)
        assert res.status_code == 200, res.text
    return times


def first_deltas(svc: ServiceProcess, n: int) -> list[float]:
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "streamer"}
    body = {"workspaceId": "ws", "documentId": "doc", "sessionId": "mnote_doc_bench"}
    out = []
    for i in range(n + 1):              # the first run makes the session; not counted
        t = time.monotonic()
        res = svc.post(f"{P}/runs", headers=h, json={**body, "message": f"[[slow:0.25]] r{i}"})
        stream = SSEStream(svc.url + f"{P}/events/{res.json()['runId']}", h)
        first = None
        for _, data in stream:
            if data["event"] == "message.delta" and first is None:
                first = time.monotonic() - t
        if i:
            out.append(first)
    return out


def aborts(svc: ServiceProcess, model: ScriptedModel, n: int) -> list[float]:
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "aborter"}
    out = []
    for i in range(n):
        marker = f"abort-bench-{i}"
        res = svc.post(f"{P}/runs", headers=h, json={
            "workspaceId": "ws", "documentId": "doc", "sessionId": "mnote_doc_abort",
            "message": f"[[slow:5]] {marker}"})
        run_id = res.json()["runId"]
        stream = SSEStream(svc.url + f"{P}/events/{run_id}", h)
        t = None
        for _, data in stream:
            if data["event"] == "message.delta" and t is None:     # mid-stream: abort now
                t = time.monotonic()
                svc.post(f"{P}/runs/{run_id}/abort", headers=h, json={})
            if data["event"] == "run.cancelled" and t is not None:
                out.append(time.monotonic() - t)
        time.sleep(3)                   # let the replacement process warm up
    return out


def acp_rss_mb(data_dir: Path) -> list[float]:
    """Tree RSS (MiB) of the service's live ACP processes: the process group leaders their
    pid records name (bwrap in a sandbox, hermes itself without one) and every descendant
    (:func:`hermes_service.sandbox.tree_rss_mb`, what ``hermes.acp.max_rss_mb`` is checked
    against)."""
    out = []
    for record in (data_dir / "pids").glob("*.json"):
        pid = int(record.stem)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"acp" in cmd:
            out.append(tree_rss_mb(pid))
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    n = args.turns
    hermes = os.environ.get("HERMES_BIN") or str(ROOT / ".hermes-venv/bin/hermes")
    model = ScriptedModel().start()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    try:
        (tmp / "cli").mkdir()
        cli = ServiceProcess(tmp / "cli", base_config(tmp / "cli", model.base_url)).start()
        try:
            cli_turns = v1_turns(cli, "bench", n, warmup=1)
            bare_home = tmp / "bare"
            shutil.copytree(tmp / "cli/data/users/bench", bare_home,
                            ignore=shutil.ignore_patterns("state.db*", "sessions", "logs"))
        finally:
            cli.stop()
        bare = bare_turns(hermes, bare_home, n, model.base_url)
        (tmp / "acp").mkdir()
        both = {"hermes": {"runner": "acp"}, "mnote": {"runner": "acp"}}
        acp = ServiceProcess(tmp / "acp", deep_merge(base_config(tmp / "acp", model.base_url),
                                                      both)).start()
        try:
            cold = cold_first_turns(acp, max(2, n // 2))
            warm = v1_turns(acp, "bench", n, warmup=1)
            deltas = first_deltas(acp, n)
            rss = acp_rss_mb(acp.data_dir)
            stops = aborts(acp, model, max(2, n // 2))
        finally:
            acp.stop()
    finally:
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    mb, mc, mw, mcold = med(bare), med(cli_turns), med(warm), med(cold)

    def row(label, values, unit="ms", scale=1000.0, note=""):
        figures = ", ".join(f"{v * scale:.0f}" for v in values)
        print(f"{label:<34} {med(values) * scale:8.0f} {unit}   ({figures}){note}")
    row("bare hermes chat turn", bare)
    row("CLI-runner service turn", cli_turns, note=f"   ratio to bare {mc / mb:.2f}")
    row("ACP warm turn", warm, note=f"   ratio to bare {mw / mb:.3f} (target <= 0.1)")
    row("ACP cold first turn", cold, note=f"   ratio to bare {mcold / mb:.2f} (target <= 1.5)")
    row("POST /runs -> first message.delta", deltas, note="   (target <= 300 ms; model pieces 50 ms apart)")
    row("abort -> run.cancelled (ACP)", stops)
    row("RSS per warm ACP process", rss, unit="MB", scale=1.0, note="   (target <= 150 MB)")


if __name__ == "__main__":
    main()

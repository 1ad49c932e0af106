"""The sandbox's cost (docs/sandbox.md): sandbox on (``hermes.sandbox.mode:
bwrap``) vs off (``none``), side by side in one run against the same scripted model.

Two services per phase, one per side, started together: first a CLI-runner pair, then an
ACP-runner pair. Every sample is taken on both sides back to back, the side that goes
first alternating from sample to sample, so both sides see the same machine load. Per
figure it prints the median and (min–max) of each side, the difference bwrap − none in ms
and the ratio bwrap / none:

* CLI turn — a v1 message on a continuing session (``hermes.runner: cli``; one warm-up
  turn per side not counted), ms;
* ACP cold first turn — a v1 session of a new user and its first message (home made,
  ``hermes acp`` started, ``initialize``, ``session/new``, prompt), ms; ⌈N/2⌉ (≥ 2)
  samples per side, as bench/runners.py takes fewer of these;
* ACP warm turn — a v1 message on a continuing session of a warm user (one warm-up turn),
  ms;
* ``POST /api/hermes/client/runs`` → first ``message.delta`` on a warm user — the mnote
  client flow of bench/runners.py (:func:`runners.first_deltas` once per sample: a run
  not counted, then the timed one; the model streams 5 pieces 50 ms apart), with the page
  in the page store (data/mnote.db), ms;
* RSS per warm ACP process, MB (MiB): every live ``hermes acp`` process of the ACP pair
  after the turns above, measured from outside the same way on both sides — the resident
  memory of the process group leader and all its descendants
  (:func:`hermes_service.sandbox.tree_rss_mb`, what the service itself uses for
  ``hermes.acp.max_rss_mb``); with the sandbox the tree holds bwrap's own processes too.

Then the target lines: sandbox overhead ≤ 5 % of a CLI turn and ≤ 10 ms on a warm turn.

Both sides reach the model through the service's pass-through endpoint
(hermes_service/model_proxy/; it is not tied to the sandbox), so the difference is the
sandbox itself; bench/model_proxy.py measures the pass-through.

    .venv/bin/python bench/sandbox.py [--turns N]      (or: make bench-sandbox)

``--turns`` N (default 5): samples per side of each figure but the cold one (~5 minutes on
2 shared cores).
Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "bench")]

from runners import first_deltas, med  # noqa: E402

from hermes_service import sandbox  # noqa: E402
from hermes_service.mnote.page_sqlite import SQLitePageStore  # noqa: E402
from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import ServiceProcess, base_config, deep_merge  # noqa: E402

SIDES = ("bwrap", "none")


def start_pair(tmp: Path, model_url: str, runner: str, extra: dict | None = None) -> dict:
    """One started service per side (``hermes.sandbox.mode`` bwrap / none), else none."""
    out = {}
    try:
        for mode in SIDES:
            d = tmp / f"{runner}-{mode}"
            d.mkdir()
            seed_page(d / "data")
            cfg = deep_merge(base_config(d, model_url),
                             {"hermes": {"runner": runner, "sandbox": {"mode": mode},
                                         **(extra or {})},
                              "mnote": {"runner": runner}})
            out[mode] = ServiceProcess(d, cfg).start()
    except BaseException:
        stop_all(out)
        raise
    return out


def stop_all(services: dict) -> None:
    for svc in services.values():
        svc.stop()


def seed_page(data_dir: Path) -> None:
    """The page runners.first_deltas' runs are about (workspace ``ws``, document ``doc``,
    actor ``streamer`` an editor), in the service's page store."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = SQLitePageStore(data_dir / "mnote.db")
    store.add_workspace("ws")
    store.add_member("ws", "streamer", "editor")
    store.import_page({"documentId": "doc", "workspaceId": "ws", "title": "bench page",
                       "blocks": [{"id": "b1", "type": "paragraph", "text": "first paragraph"}]})
    store.close()


def alternate(n: int, sample) -> dict[str, list[float]]:
    """``sample(side, i)`` → list of seconds, n times per side, the side going first
    alternating."""
    out = {s: [] for s in SIDES}
    for i in range(n):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            out[side] += sample(side, i)
    return out


def timed_message(svc: ServiceProcess, sid: str, message: str) -> float:
    """One v1 message on session ``sid``: seconds to its 200."""
    t = time.perf_counter()
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": message})
    elapsed = time.perf_counter() - t
    assert res.status_code == 200, res.text
    return elapsed


def continuing_turns(pair: dict, user: str, n: int) -> dict[str, list[float]]:
    """n timed v1 turns per side on one continuing session of ``user`` (after one warm-up)."""
    sids = {s: pair[s].post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]
            for s in SIDES}
    for s in SIDES:
        timed_message(pair[s], sids[s], "warm-up")
    return alternate(n, lambda s, i: [timed_message(pair[s], sids[s], f"turn {i}")])


def cold_turns(pair: dict, n: int) -> dict[str, list[float]]:
    """n first turns per side, each of a new user."""
    def one(side, i):
        sid = pair[side].post("/api/v1/sessions", json={"user_id": f"cold{i}"}).json()["session_id"]
        return [timed_message(pair[side], sid, "first")]
    return alternate(n, one)


def warm_acp_rss_mb(svc: ServiceProcess) -> list[float]:
    """Tree RSS (MiB) of each live ``hermes acp`` process of ``svc``: its process group
    leaders are named by ``<data>/pids/<pgid>.json`` (bwrap, or /bin/sh exec-ing bwrap when
    a cgroup is used, on the sandbox side; hermes itself on the other)."""
    out = []
    for record in sorted((svc.data_dir / "pids").glob("*.json")):
        pid = int(record.stem)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"acp" in argv:
            out.append(sandbox.tree_rss_mb(pid))
    return out


def bwrap_own_rss_mb(svc: ServiceProcess) -> list[float]:
    """Of :func:`warm_acp_rss_mb`'s trees, the part that is bwrap's own processes (its
    outer process and the PID namespace's init), MiB per tree."""
    out = []
    for record in sorted((svc.data_dir / "pids").glob("*.json")):
        pid = int(record.stem)
        try:
            if b"acp" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        kb = 0
        for p in [pid, *sandbox.descendants(pid)]:
            try:
                if os.path.basename(os.readlink(f"/proc/{p}/exe")) != "bwrap":
                    continue
                status = Path(f"/proc/{p}/status").read_text()
            except OSError:
                continue
            kb += next((int(ln.split()[1]) for ln in status.splitlines()
                        if ln.startswith("VmRSS:")), 0)
        out.append(kb / 1024)
    return out


def acp_leaders(svc: ServiceProcess) -> set[str]:
    """The basenames of the ACP process group leaders' executables (shows the side is what
    its config says)."""
    names = set()
    for record in (svc.data_dir / "pids").glob("*.json"):
        try:
            names.add(os.path.basename(os.readlink(f"/proc/{record.stem}/exe")))
        except OSError:
            pass
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=5, help="samples per side of each figure")
    args = ap.parse_args()
    n = args.turns
    probe = sandbox.probe()
    if not probe.usable:
        sys.exit(f"no usable bubblewrap here: {probe.reason}")
    t0 = time.monotonic()
    model = ScriptedModel().start()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-bench-sandbox-"))
    try:
        t_cli = time.monotonic()
        cli = start_pair(tmp, model.base_url, "cli")
        try:
            cli_turns = continuing_turns(cli, "bench", n)
        finally:
            stop_all(cli)
        # room for every user of this phase (n cold ones, bench, streamer): no cold turn
        # waits for an idle process to be closed first
        t_acp = time.monotonic()
        acp = start_pair(tmp, model.base_url, "acp", {"acp": {"max_processes": n + 4}})
        try:
            cold = cold_turns(acp, max(2, (n + 1) // 2))
            warm = continuing_turns(acp, "bench", n)
            deltas = alternate(n, lambda s, i: first_deltas(acp[s], 1))
            rss = {s: warm_acp_rss_mb(acp[s]) for s in SIDES}
            bwrap_rss = bwrap_own_rss_mb(acp["bwrap"])
            leaders = {s: acp_leaders(acp[s]) for s in SIDES}
        finally:
            stop_all(acp)
        t_end = time.monotonic()
    finally:
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()
    print(f"sandbox bwrap vs none: {n} samples per side, alternating; {os.cpu_count()} CPUs, "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {probe.bwrap}; limits: "
          f"{probe.cgroup_why}; ACP leaders: bwrap side {'/'.join(sorted(leaders['bwrap']))}, "
          f"none side {'/'.join(sorted(leaders['none']))}; CLI pair {t_acp - t_cli:.0f} s, "
          f"ACP pair {t_end - t_acp:.0f} s, {time.monotonic() - t0:.0f} s in all")
    print(f"{'':36}{'bwrap (on)':>22}{'none (off)':>22}{'difference':>14}{'ratio':>8}")

    def row(label, values, unit="ms", scale=1000.0):
        cells = []
        for s in SIDES:
            xs = values[s]
            cells.append(f"{med(xs) * scale:7.0f} ({min(xs) * scale:.0f}-{max(xs) * scale:.0f})"
                         if xs else "-")
        d = (med(values["bwrap"]) - med(values["none"])) * scale
        ratio = med(values["bwrap"]) / med(values["none"])
        print(f"{label:<36}{cells[0]:>19} {unit}{cells[1]:>19} {unit}{d:+11.0f} {unit}"
              f"{ratio:8.3f}")
        return d

    d_cli = row("CLI turn", cli_turns)
    row("ACP cold first turn", cold)
    d_warm = row("ACP warm turn", warm)
    row("POST /runs -> first message.delta", deltas)
    row("RSS per warm ACP process (tree)", rss, unit="MB", scale=1.0)
    print(f"{'  of which bwrap processes':<36}{med(bwrap_rss):7.1f} MB (per tree, bwrap side)")
    print(f"target: overhead <= 5 % of a CLI turn: {d_cli:+.0f} ms = "
          f"{100 * d_cli / (med(cli_turns['none']) * 1000):+.1f} %")
    print(f"target: overhead <= 10 ms on a warm turn: {d_warm:+.0f} ms")


if __name__ == "__main__":
    main()

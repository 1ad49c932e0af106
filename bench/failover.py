"""Failover time of nodes sharing PostgreSQL (docs/scaling.md §Failover time (RTO)).

Two real nodes (waitress subprocesses, real ``hermes`` CLI, the scripted model) on a temporary
PostgreSQL cluster (tests/support/postgres.py). ``--users`` users each hold a session with one
acknowledged turn on node n1; n1 is killed with ``kill -9`` and its data dir deleted; then each
user's next request goes to n2. Prints, per round:

* time from the kill to n2 answering the first user's panel session list (which reads the
  user's transcripts: the lease taken — waiting out n1's TTL — and the home restored), and to
  the last user's (asked one after the other);
* the restore itself (from n2's log), and the first turn on n2 after the kill;
* the median v1 CLI turn on a node with and without ``storage`` (what the commit of the home
  snapshot and the record adds to an acknowledged turn).

    .venv/bin/python bench/failover.py [--ttl 5] [--users 4] [--turns 3]

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge  # noqa: E402
from support.postgres import PASSWORD_ENV, PostgresCluster  # noqa: E402


def node(tmp: Path, model, name: str, url: str | None, ttl: float) -> ServiceProcess:
    (tmp / name).mkdir()
    extra: dict = {"service": {"node_id": name, "log_level": "debug"}}
    if url:
        extra["storage"] = {"url": url, "password_env": PASSWORD_ENV, "node_id": name,
                            "lease_ttl_seconds": ttl}
    return ServiceProcess(tmp / name, deep_merge(base_config(tmp / name, model.base_url),
                                                 extra)).start(timeout=60)


def turn_times(svc: ServiceProcess, user: str, n: int) -> list[float]:
    sid = svc.post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]
    out = []
    for i in range(n + 1):
        t = time.perf_counter()
        res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": f"t{i}"})
        assert res.status_code == 200, res.text
        out.append(time.perf_counter() - t)
    return out[1:]                               # the first turn makes the home: left out


def until_ok(fn, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        res = fn()
        if res.status_code == 200:
            return time.monotonic()
        time.sleep(0.05)
    raise RuntimeError("not served within the timeout")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttl", type=float, default=5.0, help="storage.lease_ttl_seconds")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3, help="turns per overhead sample")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    model = ScriptedModel("scripted-model").start()
    cluster = PostgresCluster()
    started: list[ServiceProcess] = []
    try:
        url = cluster.url(cluster.create_database())
        n1, n2 = (node(tmp, model, n, url, args.ttl) for n in ("n1", "n2"))
        plain = node(tmp, model, "plain", None, args.ttl)
        started += [n1, n2, plain]
        shared_t = turn_times(n2, "bench-overhead", args.turns)
        plain_t = turn_times(plain, "bench-overhead", args.turns)
        sids = {}
        for i in range(args.users):
            user = f"u{i}"
            sids[user] = n1.post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]
            assert n1.post(f"/api/v1/sessions/{sids[user]}/messages",
                           json={"message": f"before {user}"}).status_code == 200
        killed = time.monotonic()
        os.killpg(n1.proc.pid, signal.SIGKILL)
        n1.proc.wait(10)
        shutil.rmtree(n1.data_dir)
        # the panel's session list reads the user's transcripts: it takes the lease (waiting
        # out n1's) and restores the home before it answers
        served = [until_ok(lambda u=u: n2.get(
            "/api/hermes/client/sessions?workspaceId=w&documentId=d",
            headers={"X-API-Key": API_KEY, "X-Mnote-Actor-Id": u})) - killed for u in sids]
        assert all(n2.get(f"/api/v1/sessions?user_id={u}").json()["sessions"] for u in sids)
        t = time.monotonic()
        res = n2.post(f"/api/v1/sessions/{sids['u0']}/messages", json={"message": "[[recall]]"})
        first_turn = time.monotonic() - t
        assert res.status_code == 200 and res.json()["response"].endswith("before u0")
        restores = [float(m) for m in re.findall(r"restored the home of user u\d+ from "
                                                 r"snapshot \d+ \(\d+ files, \d+ bytes, "
                                                 r"([0-9.]+) s\)", n2.log())]
        print(f"lease TTL {args.ttl:g} s, {args.users} users on the killed node")
        print(f"  first user served on n2 after the kill: {served[0]:6.2f} s")
        print(f"  last user served on n2 after the kill:  {served[-1]:6.2f} s")
        if restores:
            print(f"  home restore (n2's log): median {statistics.median(restores) * 1000:.0f} "
                  f"ms, max {max(restores) * 1000:.0f} ms")
        print(f"  first turn on n2 after it:             {first_turn:6.2f} s")
        commits = [float(m) for m in re.findall(r"committed with snapshot .*? commit "
                                                r"([0-9.]+) s\)", n2.log())]
        if commits:
            print(f"commit of an acknowledged turn (home snapshot + record, fenced), n2's log: "
                  f"median {statistics.median(commits) * 1000:.0f} ms, max "
                  f"{max(commits) * 1000:.0f} ms over {len(commits)} turns")
        print(f"v1 CLI turn, median of {args.turns}: plain node "
              f"{statistics.median(plain_t):.2f} s, with storage "
              f"{statistics.median(shared_t):.2f} s "
              f"(+{(statistics.median(shared_t) - statistics.median(plain_t)) * 1000:.0f} ms)")
    finally:
        for svc in started:
            svc.stop()
        cluster.cleanup()
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

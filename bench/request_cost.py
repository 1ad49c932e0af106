"""Per-request cost of the light routes: hermes-service vs a bare Flask + waitress app.

Starts the real service (``main.py``: waitress, the config's ``service.threads``) and a bare
Flask app served by waitress with the same thread count, then runs ``wrk`` (8 connections,
2 threads) against, alternately:

* the bare app's ``GET /health`` (a constant JSON object: no hooks, no log, no metrics);
* the service's ``GET /health`` (no key needed: ``security.health_requires_api_key`` false);
* the service's ``GET /api/hermes/client/tools`` (an API key with the ``client`` scope).

The runs alternate (bare, the two service routes, bare, …) and each service run is set
against the mean of the bare runs just before and after it, so a noisy neighbour weighs on
both sides of a ratio alike; the table gives each side's median requests/s and the median of
its ratios to bare. Each run also measures the server process's CPU time per request
(``/proc/<pid>/stat``): on a busy shared machine the req/s of both sides swing with the
neighbours' load, while CPU per request barely moves, so bare's CPU per request over the
service's is the steadier estimate of the ratio on an idle machine; both are printed.

    python3 bench/request_cost.py [--rounds 3] [--seconds 5] [--log-format text|json]
    make bench-requests

Needs ``wrk`` (Debian package ``wrk``; ``make bench-requests`` installs it when root). The
service logs its access lines to a file in the temp folder, as it would in production.
Figures, not asserts: the machines are shared and noisy (docs: the benchmark section).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "bench-key-0123456789abcdef"
ROUTES = {"/health": {}, "/api/hermes/client/tools": {"X-API-Key": API_KEY}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shipped_threads() -> int:
    """``service.threads`` of the shipped config.yaml (what ``make run`` serves with)."""
    return int(yaml.safe_load((ROOT / "config.yaml").read_text())["service"]["threads"])


def hermes_bin() -> str:
    for cand in (os.environ.get("HERMES_BIN"), str(ROOT / ".hermes-venv/bin/hermes"),
                 shutil.which("hermes")):
        if cand and os.access(cand, os.X_OK):
            return cand
    sys.exit("the hermes CLI is not installed (make setup installs it into .hermes-venv); "
             "/health would be degraded without it")


def service_config(tmp: Path, threads: int, log_format: str) -> dict:
    return {
        "security": {"enable_ip_check": True, "allowed_ips": ["127.0.0.1", "::1"],
                     "enable_api_key": True, "auth_method": "header",
                     "api_keys": [{"key": API_KEY, "description": "bench",
                                   "scopes": ["v1", "client"]}]},
        "service": {"host": "127.0.0.1", "threads": threads, "log_level": "info",
                    "log_format": log_format, "drain_seconds": 0},
        "hermes": {"command": hermes_bin(),
                   "model": {"provider": "custom", "base_url": "http://127.0.0.1:9/v1",
                             "default": "bench-model", "api_key_env": "BENCH_PROVIDER_KEY"}},
        "paths": {"data_dir": str(tmp / "data"), "users_template": str(ROOT / "users_template")},
        "retention": {"interval_seconds": 0},
    }


def wait_up(url: str, proc: subprocess.Popen, log: Path, headers: dict | None = None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url}: the server exited rc={proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                        timeout=1) as res:
                if res.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{url} did not answer 200:\n{log.read_text()}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Side:
    """One side of the comparison: a URL, its headers and the server process answering it."""

    def __init__(self, name: str, url: str, headers: dict, pid: int):
        self.name, self.url, self.headers, self.pid = name, url, headers, pid
        self.rates: list[float] = []
        self.cpu_ms: list[float] = []     # server CPU per request

    def run(self, seconds: int, connections: int) -> float:
        before = cpu_seconds(self.pid)
        rate, count = wrk(self.url, self.headers, seconds, connections)
        self.rates.append(rate)
        self.cpu_ms.append((cpu_seconds(self.pid) - before) * 1000 / max(count, 1))
        return rate


def wrk(url: str, headers: dict, seconds: int, connections: int) -> tuple[float, int]:
    """Requests/s and requests of one wrk run (non-2xx answers make the run fail)."""
    cmd = ["wrk", "-t2", f"-c{connections}", f"-d{int(seconds)}s", url]
    for name, value in headers.items():
        cmd[1:1] = ["-H", f"{name}: {value}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out:
        sys.exit(f"{url}: non-2xx answers:\n{out}")
    return (float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1)),
            int(re.search(r"([0-9]+) requests in", out).group(1)))


def serve_bare(port: int, threads: int) -> None:
    """The bare side: one Flask route answering a constant JSON object, on waitress."""
    from flask import Flask, jsonify
    from waitress import serve
    app = Flask("bare")

    @app.get("/health")
    def health():
        return jsonify(status="healthy", service="bare", multi_user=True)
    serve(app, host="127.0.0.1", port=port, threads=threads, _quiet=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5, help="length of one wrk run")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None,
                    help="waitress threads of both sides (default: config.yaml's service.threads)")
    ap.add_argument("--log-format", choices=("text", "json"), default="text")
    ap.add_argument("--serve-bare", nargs=2, type=int, metavar=("PORT", "THREADS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_bare:
        serve_bare(*args.serve_bare)
        return
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (apt-get install wrk, or make bench-requests as root)")
    threads = args.threads or shipped_threads()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-bench-requests-"))
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(service_config(tmp, threads, args.log_format)))
    svc_port, bare_port = free_port(), free_port()
    env = {**os.environ, "BENCH_PROVIDER_KEY": "sk-bench"}
    procs = []
    try:
        svc_log, bare_log = tmp / "service.log", tmp / "bare.log"
        svc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "--config", str(cfg_path),
                                "--port", str(svc_port)], cwd=ROOT, env=env,
                               stdout=svc_log.open("wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        procs.append(svc)
        bare = subprocess.Popen([sys.executable, __file__, "--serve-bare", str(bare_port),
                                 str(threads)], stdout=bare_log.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(bare)
        svc_url, bare_url = f"http://127.0.0.1:{svc_port}", f"http://127.0.0.1:{bare_port}"
        wait_up(bare_url + "/health", bare, bare_log)
        for path, headers in ROUTES.items():
            wait_up(svc_url + path, svc, svc_log, headers)
        bare_side = Side("bare /health", bare_url + "/health", {}, bare.pid)
        sides = [Side(f"service {path}", svc_url + path, headers, svc.pid)
                 for path, headers in ROUTES.items()]
        for side in (bare_side, *sides):       # warm up: imports, caches, first connections
            wrk(side.url, side.headers, 1, args.connections)
        # B S1 S2 B S1 S2 … B: each service run is set against the bare runs on either side
        ratios: dict[str, list[float]] = {side.name: [] for side in sides}
        bare_side.run(args.seconds, args.connections)
        for r in range(args.rounds):
            for side in sides:
                side.run(args.seconds, args.connections)
            bare_side.run(args.seconds, args.connections)
            around = (bare_side.rates[-2] + bare_side.rates[-1]) / 2
            for side in sides:
                ratios[side.name].append(side.rates[-1] / around)
            print(f"round {r + 1}/{args.rounds}: bare {around:.0f} req/s, " + ", ".join(
                f"{side.name} {side.rates[-1]:.0f} ({ratios[side.name][-1]:.2f})"
                for side in sides), flush=True)
        bare_cpu = statistics.median(bare_side.cpu_ms)
        print(f"\nwrk -c{args.connections}, {args.seconds} s runs, {args.rounds} rounds, "
              f"waitress threads {threads}, log_format {args.log_format}, "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"{'side':<34} {'req/s':>7} {'vs bare':>8} {'CPU ms/req':>11} {'bare/CPU':>9}")
        print(f"{bare_side.name:<34} {statistics.median(bare_side.rates):>7.0f} {1:>8.2f} "
              f"{bare_cpu:>11.3f} {1:>9.2f}")
        for side in sides:
            cpu = statistics.median(side.cpu_ms)
            print(f"{side.name:<34} {statistics.median(side.rates):>7.0f} "
                  f"{statistics.median(ratios[side.name]):>8.2f} {cpu:>11.3f} "
                  f"{bare_cpu / cpu:>9.2f}")
        print("req/s: median of the runs; vs bare: median over the rounds of a run's req/s over "
              "the mean of the bare runs\nbefore and after it. CPU ms/req: the server process's "
              "CPU time per answered request\n(median); bare/CPU: bare's over this side's, the "
              "req/s ratio to expect on an idle machine.")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

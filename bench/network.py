"""The cost of a network namespace per sandbox (docs/sandbox.md §Network): ``hermes.sandbox.
network: isolated`` vs ``host``, side by side in one run against the same scripted model, and
the egress proxy against a direct download.

Sandboxed turns, one service per side (both ``mode: bwrap``), every sample taken on both
sides back to back with the side going first alternating:

* sandbox start — :meth:`Sandbox.prepare` and a run of ``/usr/bin/true`` in the sandbox (the
  network namespace and the sandbox's sockets included), ms;
* CLI turn, ACP cold first turn, ACP warm turn, ``POST /api/hermes/client/runs`` → first
  ``message.delta`` on a warm user — as bench/sandbox.py takes them, ms.

The egress proxy, in this process: a loopback origin serving 1 KiB and 64 MiB; through the
whole path a tool's request takes (a TCP connection to the forwarder the Hermes process runs,
its relay to the sandbox's ``egress.sock``, the proxy's ``CONNECT``, the origin) against a
direct connection to the origin: time to the first byte of a 1 KiB answer per request (a new
connection each) and MB/s of the 64 MiB one. The proxy's own name check is replaced by one
resolving to the loopback origin (the real one refuses loopback); everything else is the
service's code.

Targets: ≤ 5 ms added to the first token and to a warm turn, ≤ 2 % of a CLI turn.

    .venv/bin/python bench/network.py [--turns N]      (or: make bench-network)

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "bench")]

from runners import first_deltas, med  # noqa: E402
from sandbox import seed_page, timed_message  # noqa: E402

from hermes_service import sandbox  # noqa: E402
from hermes_service.hermes_site import netforward  # noqa: E402
from hermes_service.homes.users import HERMES_SITE, UserHome  # noqa: E402
from hermes_service.sandbox.net.egress_policy import Policy  # noqa: E402
from hermes_service.sandbox.net.sockets import SandboxNet  # noqa: E402
from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import ServiceProcess, base_config, deep_merge  # noqa: E402

SIDES = ("isolated", "host")


def alternate(n: int, sample) -> dict[str, list[float]]:
    out = {s: [] for s in SIDES}
    for i in range(n):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            out[side] += sample(side, i)
    return out


def start_pair(tmp: Path, model_url: str, runner: str) -> dict:
    out = {}
    try:
        for side in SIDES:
            d = tmp / f"{runner}-{side}"
            d.mkdir()
            seed_page(d / "data")
            cfg = deep_merge(base_config(d, model_url), {
                "hermes": {"runner": runner, "acp": {"max_processes": 12},
                           "sandbox": {"mode": "bwrap", "network": side,
                                       "allow_host_network": True}},
                "mnote": {"runner": runner}})
            out[side] = ServiceProcess(d, cfg).start()
    except BaseException:
        for svc in out.values():
            svc.stop()
        raise
    return out


def sandbox_starts(tmp: Path, n: int) -> dict[str, list[float]]:
    root = tmp / "start"
    (root / "users" / "u" / ".hermes").mkdir(parents=True)
    home = UserHome("u", root / "users" / "u", root / "users" / "u" / ".hermes")
    launchers = {side: sandbox.Sandbox(sandbox.Settings(mode="bwrap", network=side,
                                                        allow_host_network=True),
                                       root / side, HERMES_SITE) for side in SIDES}

    def one(side, _i):
        t = time.perf_counter()
        made = launchers[side].prepare([], {"PATH": "/usr/bin:/bin"}, home, None,
                                       "/usr/bin/true")
        proc = subprocess.Popen(made.argv, env=made.env, cwd=made.cwd, pass_fds=made.pass_fds)
        made.started()
        proc.wait()
        made.close()
        return [time.perf_counter() - t]
    try:
        return alternate(n * 4, one)
    finally:
        for launcher in launchers.values():
            launcher.close()


class Origin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    big = os.urandom(1 << 20) * 64

    def do_GET(self):
        body = b"x" * 1024 if self.path == "/small" else self.big
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def fetch(port: int, path: str, via_proxy: bool) -> tuple[float, int]:
    """(seconds to the first byte, bytes) of ``GET path`` on a new connection."""
    t = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", port))
    if via_proxy:
        s.sendall(b"CONNECT origin.bench:80 HTTP/1.1\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
    s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
    first = s.recv(65536)
    ttfb = time.perf_counter() - t
    total = len(first)
    while chunk := s.recv(1 << 20):
        total += len(chunk)
    s.close()
    return ttfb, total


def egress(tmp: Path, n: int) -> dict:
    origin = ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    oport = origin.server_address[1]
    net = SandboxNet(tmp / "egress-net", Policy.from_lists(["origin.bench"], []))

    net.resolve = lambda host, port: ([(socket.AF_INET, ("127.0.0.1", oport))], None)
    att = net.attach("bench")
    fport = socket.socket()
    fport.bind(("127.0.0.1", 0))
    forward_port = fport.getsockname()[1]
    fport.close()
    forwarder = netforward.Forwarder([(forward_port, str(att.folder / "egress.sock"))])
    threading.Thread(target=forwarder.run, daemon=True).start()
    try:
        out = {"ttfb": {"proxy": [], "direct": []}, "mbps": {"proxy": [], "direct": []}}
        for i in range(n * 20):
            for side in (("proxy", "direct") if i % 2 == 0 else ("direct", "proxy")):
                port = forward_port if side == "proxy" else oport
                out["ttfb"][side].append(fetch(port, "/small", side == "proxy")[0])
        for i in range(max(3, n)):
            for side in (("proxy", "direct") if i % 2 == 0 else ("direct", "proxy")):
                port = forward_port if side == "proxy" else oport
                t = time.perf_counter()
                _, size = fetch(port, "/big", side == "proxy")
                out["mbps"][side].append(size / (time.perf_counter() - t) / 1e6)
        return out
    finally:
        net.close()
        origin.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=5, help="samples per side of each figure")
    args = ap.parse_args()
    n = args.turns
    if not sandbox.probe().usable:
        sys.exit(f"no usable bubblewrap here: {sandbox.probe().reason}")
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-bench-network-"))
    model = ScriptedModel().start()
    try:
        starts = sandbox_starts(tmp, n)
        proxy = egress(tmp, n)
        cli = start_pair(tmp, model.base_url, "cli")
        try:
            sids = {s: cli[s].post("/api/v1/sessions", json={"user_id": "b"}).json()["session_id"]
                    for s in SIDES}
            for s in SIDES:
                timed_message(cli[s], sids[s], "warm-up")
            cli_turns = alternate(n, lambda s, i: [timed_message(cli[s], sids[s], f"t{i}")])
        finally:
            for svc in cli.values():
                svc.stop()
        acp = start_pair(tmp, model.base_url, "acp")
        try:
            def cold(s, i):
                sid = acp[s].post("/api/v1/sessions",
                                  json={"user_id": f"cold{i}"}).json()["session_id"]
                return [timed_message(acp[s], sid, "first")]
            colds = alternate(max(2, (n + 1) // 2), cold)
            sids = {s: acp[s].post("/api/v1/sessions", json={"user_id": "w"}).json()["session_id"]
                    for s in SIDES}
            for s in SIDES:
                timed_message(acp[s], sids[s], "warm-up")
            warm = alternate(n, lambda s, i: [timed_message(acp[s], sids[s], f"t{i}")])
            deltas = alternate(n, lambda s, i: first_deltas(acp[s], 1))
        finally:
            for svc in acp.values():
                svc.stop()
    finally:
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()
    print(f"network isolated vs host (both bwrap): {n} samples per side, alternating; "
          f"{os.cpu_count()} CPUs, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{time.monotonic() - t0:.0f} s in all")
    print(f"{'':36}{'isolated':>22}{'host':>22}{'difference':>14}{'ratio':>8}")

    def row(label, values, a="isolated", b="host", unit="ms", scale=1000.0):
        cells = [f"{med(values[s]) * scale:7.1f} ({min(values[s]) * scale:.1f}-"
                 f"{max(values[s]) * scale:.1f})" for s in (a, b)]
        d = (med(values[a]) - med(values[b])) * scale
        print(f"{label:<36}{cells[0]:>19} {unit}{cells[1]:>19} {unit}{d:+11.1f} {unit}"
              f"{med(values[a]) / med(values[b]):8.3f}")
        return d
    row("sandbox start (true)", starts)
    d_cli = row("CLI turn", cli_turns)
    row("ACP cold first turn", colds)
    d_warm = row("ACP warm turn", warm)
    d_first = row("POST /runs -> first message.delta", deltas)
    print(f"{'':36}{'egress proxy':>22}{'direct':>22}")
    row("1 KiB GET, new connection: 1st byte", proxy["ttfb"], "proxy", "direct")
    row("64 MiB GET: throughput", proxy["mbps"], "proxy", "direct", unit="MB/s", scale=1.0)
    print(f"target: <= 5 ms on the first token: {d_first:+.1f} ms; on a warm turn: "
          f"{d_warm:+.1f} ms; <= 2 % of a CLI turn: "
          f"{100 * d_cli / (med(cli_turns['host']) * 1000):+.1f} %")


if __name__ == "__main__":
    main()

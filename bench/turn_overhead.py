"""Turn overhead: N turns through hermes-service vs N bare ``hermes chat`` runs.

Both sides use the same scripted model (hermes_service/scripted_model/) and the same
Hermes home settings (the service's user home is rendered from
users_template/; the bare runs use a copy of that rendered home). Prints the
median wall time per turn of each side and the ratio service/bare, plus the
time-to-first-byte of an SSE event stream.

    python3 bench/turn_overhead.py [--turns N]      (or: make bench)

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import API_KEY, PROVIDER_KEY_ENV, ServiceProcess, base_config  # noqa: E402
from support.sse_client import SSEStream  # noqa: E402


def service_turns(svc: ServiceProcess, n: int) -> list[float]:
    sid = svc.post("/api/v1/sessions", json={"user_id": "bench"}).json()["session_id"]
    times = []
    for i in range(n):
        t = time.perf_counter()
        res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": f"turn {i}"})
        times.append(time.perf_counter() - t)
        assert res.status_code == 200, res.text
    return times


def bare_turns(hermes: str, home_root: Path, n: int, model_url: str) -> list[float]:
    # the rendered home names the service's model pass-through (homes/users.py); the bare
    # runs go to the scripted model directly
    env = {"PATH": os.environ["PATH"], "HOME": str(home_root), "HERMES_HOME": str(home_root / ".hermes"),
           "LANG": "C.UTF-8", PROVIDER_KEY_ENV: "sk-scripted", "HERMES_STREAM_RETRIES": "0",
           "HERMES_SERVICE_MODEL_URL": model_url, "HERMES_SERVICE_MODEL_KEY": "sk-scripted"}
    times, resume = [], []
    for i in range(n):
        t = time.perf_counter()
        res = subprocess.run([hermes, "chat", f"--query=turn {i}", "-Q", "--source", "tool",
                              "-t", "context_engine", *resume], env=env, cwd=home_root,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
        times.append(time.perf_counter() - t)
        assert res.returncode == 0, res.stdout + res.stderr
        resume = ["--resume", res.stderr.strip().splitlines()[-1].split()[-1]]
    return times


def sse_first_byte(svc: ServiceProcess) -> tuple[float, float]:
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "bench"}
    t = time.monotonic()
    res = svc.post("/api/hermes/client/runs", headers=h, json={
        "workspaceId": "ws", "documentId": "doc", "sessionId": "mnote_doc_bench", "message": "hi"})
    stream = SSEStream(svc.url + f"/api/hermes/client/events/{res.json()['runId']}", h)
    list(stream)
    return stream.first_byte_at - t, time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    hermes = os.environ.get("HERMES_BIN") or str(ROOT / ".hermes-venv/bin/hermes")
    model = ScriptedModel().start()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    svc = ServiceProcess(tmp, base_config(tmp, model.base_url)).start()
    try:
        service = service_turns(svc, args.turns)
        bare_home = tmp / "bare"
        shutil.copytree(tmp / "data/users/bench", bare_home,
                        ignore=shutil.ignore_patterns("state.db*", "sessions", "logs"))
        bare = bare_turns(hermes, bare_home, args.turns, model.base_url)
        first_byte, whole = sse_first_byte(svc)
    finally:
        svc.stop()
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ms, mb = statistics.median(service), statistics.median(bare)
    print(f"turns per side:            {args.turns}")
    print(f"service turn median:       {ms * 1000:8.0f} ms   ({', '.join(f'{t:.2f}' for t in service)} s)")
    print(f"bare hermes turn median:   {mb * 1000:8.0f} ms   ({', '.join(f'{t:.2f}' for t in bare)} s)")
    print(f"ratio service/bare:        {ms / mb:8.3f}")
    print(f"overhead per turn:         {(ms - mb) * 1000:8.0f} ms")
    print(f"SSE first byte after POST: {first_byte * 1000:8.1f} ms   (whole run {whole:.2f} s)")


if __name__ == "__main__":
    main()

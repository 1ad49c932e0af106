"""First token: the OpenAI-compatible stream against the panel's, on the same runner
(docs/benchmarks.md §First token of the OpenAI-compatible routes).

One service (``mnote.runner`` and ``openai.runner`` both ``acp``: each family has warm
``hermes acp`` processes of its own), one scripted model (``[[slow:0.25]]``: the answer in 5
pieces 50 ms apart), a warm user on an existing conversation of each, the two sides taken
alternately so that a noisy machine weighs on both alike:

* **panel**: ``POST /api/hermes/client/runs`` sent → first ``message.delta`` on its event
  stream (``bench/first_token.py``'s measure);
* **openai**: ``POST /v1/chat/completions`` with ``"stream": true`` and the conversation's
  ``X-Hermes-Session-Id`` sent → first chunk with content received.

Prints both medians (ms), every sample and the difference (target: ≤ 5 ms added).

    .venv/bin/python bench/openai_first_token.py [--turns N]   (or: make bench-openai-first-token)

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "bench")]

from first_token import MESSAGE, panel_first_delta  # noqa: E402

from hermes_service.scripted_model import ScriptedModel  # noqa: E402
from support.fixtures import ServiceProcess, base_config, deep_merge  # noqa: E402

KEY = "bench-openai-key-0123456789"


def openai_first_chunk(svc: ServiceProcess, sid: str | None, text: str) -> tuple[float, str]:
    """Seconds from the request sent to the first content chunk (waits for ``[DONE]``), and
    the conversation's id."""
    head = {"Authorization": f"Bearer {KEY}", **({"X-Hermes-Session-Id": sid} if sid else {})}
    t = time.perf_counter()
    res = requests.post(svc.url + "/v1/chat/completions", headers=head, stream=True,
                        timeout=180, json={"model": "hermes", "stream": True,
                                           "messages": [{"role": "user", "content": text}]})
    first = None
    for line in res.iter_lines():
        if line.startswith(b"data: {") and first is None:
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t
    if first is None:
        raise RuntimeError(f"no content chunk:\n{svc.log()[-3000:]}")
    return first, res.headers["X-Hermes-Session-Id"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=15)
    args = ap.parse_args()
    model = ScriptedModel().start()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-openai-first-token-"))
    svc = None
    try:
        cfg = deep_merge(base_config(tmp, model.base_url), {
            "mnote": {"runner": "acp"}, "openai": {"runner": "acp"}})
        cfg["security"]["api_keys"].append({"key": KEY, "user_id": "bench",
                                            "scopes": ["openai"]})
        svc = ServiceProcess(tmp, cfg).start()
        sid = None
        for i in range(2):                     # warm both: process, session, caches
            panel_first_delta(svc, MESSAGE.format(side="panel warm-up", i=i))
            _, sid = openai_first_chunk(svc, sid, MESSAGE.format(side="openai warm-up", i=i))
        p, o = [], []
        for i in range(args.turns):
            p.append(panel_first_delta(svc, MESSAGE.format(side="panel", i=i)))
            o.append(openai_first_chunk(svc, sid, MESSAGE.format(side="openai", i=i))[0])
    finally:
        if svc is not None:
            svc.stop()
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def row(label, values):
        figures = ", ".join(f"{v * 1000:.0f}" for v in values)
        print(f"{label:<50} {statistics.median(values) * 1000:7.1f} ms   ({figures})")
    row("panel: POST /runs -> first message.delta", p)
    row("openai: POST /v1/chat/completions -> first chunk", o)
    diff = statistics.median(o) - statistics.median(p)
    pairs = statistics.median(x - y for x, y in zip(o, p, strict=False))
    print(f"{'openai minus panel (median difference)':<50} {diff * 1000:7.1f} ms   "
          f"(median of paired differences {pairs * 1000:.1f} ms; target <= 5 ms)")


if __name__ == "__main__":
    main()

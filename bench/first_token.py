"""First token: the panel against a bare ACP client of the same ``hermes acp`` (docs/runners.md
"First token").

One run, one scripted model (``[[slow:0.25]]``: the answer in 5 pieces 50 ms apart), the two
sides taken alternately so that a noisy machine weighs on both alike:

* **bare**: a plain Agent Client Protocol client (the ``agent-client-protocol`` package the
  service speaks it with) of one ``hermes acp`` process of its own, on a home that names the
  scripted model directly, one warm session: ``session/prompt`` sent → first
  ``agent_message_chunk`` received;
* **panel**: the service (``mnote.runner: acp``, its defaults otherwise: sandbox, model
  pass-through), a warm user on an existing session: ``POST /api/hermes/client/runs`` sent →
  first ``message.delta`` received on its event stream.

Prints both medians (ms), every sample, and the difference — the service's added latency
(target ≤ 20 ms).

    .venv/bin/python bench/first_token.py [--turns N]      (or: make bench-first-token)

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hermes_service.scripted_model import ScriptedModel, hermes_env, write_hermes_config  # noqa: E402
from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge  # noqa: E402
from support.sse_client import SSEStream  # noqa: E402

P = "/api/hermes/client"
MESSAGE = "[[slow:0.25]] first token {side} {i}"


class BareAcp:
    """One ``hermes acp`` process and one session, spoken to from a loop of its own."""

    def __init__(self, hermes: str, home: Path):
        self.hermes, self.home = hermes, home
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.first: asyncio.Future | None = None
        self._run(self._start())

    def _run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        import acp
        from acp.schema import ClientCapabilities, Implementation
        outer = self

        class Client:
            async def session_update(self, session_id, update, **_kw):
                if getattr(update, "session_update", None) == "agent_message_chunk" \
                        and outer.first is not None and not outer.first.done():
                    outer.first.set_result(time.perf_counter())

            async def request_permission(self, *_a, **_kw):
                raise RuntimeError("no permissions in this bench")

            async def ext_method(self, method, params):
                return {}

            async def ext_notification(self, method, params):
                return None

            def on_connect(self, conn):
                pass
        env = hermes_env(self.home, "BENCH_KEY")
        self.proc = await asyncio.create_subprocess_exec(
            self.hermes, "acp", env=env, cwd=str(self.home), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True, limit=50 * 1024 * 1024)
        self.conn = acp.connect_to_agent(Client(), self.proc.stdin, self.proc.stdout)
        await self.conn.initialize(protocol_version=acp.PROTOCOL_VERSION,
                                   client_capabilities=ClientCapabilities(),
                                   client_info=Implementation(name="bench", version="1"))
        self.sid = (await self.conn.new_session(cwd=str(self.home))).session_id

    async def _prompt(self, text: str) -> float:
        from acp import text_block
        from acp.schema import ImageContentBlock
        self.first = self.loop.create_future()
        t = time.perf_counter()
        # the same prompt blocks as the service sends (the image block: never a slash command)
        await self.conn.prompt(prompt=[text_block(text), ImageContentBlock(
            type="image", data="", mime_type="image/png")], session_id=self.sid)
        return self.first.result() - t

    def first_chunk(self, text: str) -> float:
        """Seconds from ``session/prompt`` sent to the first message chunk (waits for the end)."""
        return self._run(self._prompt(text))

    def close(self) -> None:
        async def stop():
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            await self.proc.wait()
            await self.conn.close()
        try:
            self._run(stop(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


def panel_first_delta(svc: ServiceProcess, text: str) -> float:
    """Seconds from ``POST /runs`` sent to the first ``message.delta`` (waits for the end)."""
    h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "bench"}
    t = time.perf_counter()
    res = svc.post(f"{P}/runs", headers=h, json={"workspaceId": "ws", "documentId": "doc",
                                                 "sessionId": "mnote_doc_first", "message": text})
    first = None
    for _, data in SSEStream(svc.url + f"{P}/events/{res.json()['runId']}", h):
        if data["event"] == "message.delta" and first is None:
            first = time.perf_counter() - t
    if first is None:
        raise RuntimeError(f"no message.delta:\n{svc.log()[-3000:]}")
    return first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=15)
    args = ap.parse_args()
    hermes = os.environ.get("HERMES_BIN") or str(ROOT / ".hermes-venv/bin/hermes")
    model = ScriptedModel().start()
    tmp = Path(tempfile.mkdtemp(prefix="hermes-first-token-"))
    bare = svc = None
    try:
        home = tmp / "bare" / ".hermes"
        write_hermes_config(home, model.base_url, model.model_id, "BENCH_KEY")
        bare = BareAcp(hermes, home)
        (tmp / "svc").mkdir()
        svc = ServiceProcess(tmp / "svc", deep_merge(base_config(tmp / "svc", model.base_url),
                                                     {"mnote": {"runner": "acp"}})).start()
        for i in range(2):                     # warm both: process, session, caches
            bare.first_chunk(MESSAGE.format(side="bare warm-up", i=i))
            panel_first_delta(svc, MESSAGE.format(side="panel warm-up", i=i))
        b, p = [], []
        for i in range(args.turns):
            b.append(bare.first_chunk(MESSAGE.format(side="bare", i=i)))
            p.append(panel_first_delta(svc, MESSAGE.format(side="panel", i=i)))
    finally:
        if bare is not None:
            bare.close()
        if svc is not None:
            svc.stop()
        model.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def row(label, values):
        figures = ", ".join(f"{v * 1000:.0f}" for v in values)
        print(f"{label:<44} {statistics.median(values) * 1000:7.1f} ms   ({figures})")
    row("bare ACP client: prompt -> first chunk", b)
    row("panel: POST /runs -> first message.delta", p)
    diff = statistics.median(p) - statistics.median(b)
    pairs = statistics.median(x - y for x, y in zip(p, b, strict=False))
    print(f"{'added by the service (median difference)':<44} {diff * 1000:7.1f} ms   "
          f"(median of paired differences {pairs * 1000:.1f} ms; target <= 20 ms)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A stand-in for ``hermes acp`` in the ACP pool's unit tests (tests/test_acp_pool.py):
a real Agent Client Protocol agent on stdio (the ``agent-client-protocol`` package the
service itself speaks it with) that starts at once and answers ``session/new`` after
``FAKE_ACP_NEW_SESSION_DELAY`` seconds (default 0; a large value stands for a Hermes that
never answers) and ``session/load`` after ``FAKE_ACP_LOAD_DELAY``. Each request it receives
is logged to ``FAKE_ACP_LOG`` when set, one line as it arrives (``new`` or ``load <id>``), so
tests wait for what the agent got instead of guessing how long it takes. No model, no
state.db: the pool, not the turn, is under test."""
import asyncio
import os
import sys
import uuid

import acp
from acp.schema import AgentCapabilities, InitializeResponse, NewSessionResponse, PromptResponse


def _log(line: str) -> None:
    if os.environ.get("FAKE_ACP_LOG"):
        with open(os.environ["FAKE_ACP_LOG"], "a") as log:
            log.write(line + "\n")


class FakeAgent:
    def on_connect(self, conn) -> None:
        self.conn = conn

    async def initialize(self, protocol_version, client_capabilities=None, client_info=None, **_kw):
        return InitializeResponse(protocol_version=protocol_version,
                                  agent_capabilities=AgentCapabilities(load_session=True))

    async def new_session(self, cwd, mcp_servers=None, **_kw):
        _log("new")
        await asyncio.sleep(float(os.environ.get("FAKE_ACP_NEW_SESSION_DELAY", "0")))
        return NewSessionResponse(session_id=str(uuid.uuid4()))

    async def load_session(self, cwd, session_id, mcp_servers=None, **_kw):
        _log(f"load {session_id}")
        await asyncio.sleep(float(os.environ.get("FAKE_ACP_LOAD_DELAY", "0")))
        return None

    async def prompt(self, prompt, session_id, **_kw):
        return PromptResponse(stop_reason="end_turn")

    async def cancel(self, session_id, **_kw):
        return None


if __name__ == "__main__":
    sys.exit(asyncio.run(acp.run_agent(FakeAgent())))

#!/usr/bin/env python3
"""A stand-in for ``hermes acp`` in the ACP pool's unit tests (tests/unit/runner/test_acp_pool.py):
a real Agent Client Protocol agent on stdio (the ``agent-client-protocol`` package the
service itself speaks it with) that starts at once and answers ``session/new`` after
``FAKE_ACP_NEW_SESSION_DELAY`` seconds (default 0; a large value stands for a Hermes that
never answers) and ``session/load`` after ``FAKE_ACP_LOAD_DELAY``. Each request it receives
is logged to ``FAKE_ACP_LOG`` when set, one line as it arrives (``new`` or ``load <id>``), so
tests wait for what the agent got instead of guessing how long it takes. No model: the
pool, not the turn, is under test.

A stopped turn (``FAKE_ACP_STREAM``: pieces separated by ``|``): a prompt streams them as
``agent_message_chunk`` updates (``FAKE_ACP_PIECE_DELAY`` s apart, default 0.05), then waits
until ``session/cancel``; ``FAKE_ACP_CANCEL=honour`` (the default) ends it then with
``stopReason: cancelled``, ``ignore`` never ends it (a Hermes whose cancel does not land).
With ``HERMES_HOME`` set the agent keeps ``state.db`` as Hermes 0.19.0 does
(tests/support/hermes_record.py): the session row at ``session/new``, the user row when the prompt
starts, and, on an honoured cancel, the streamed text as the interrupted reply; a prompt
without ``FAKE_ACP_STREAM`` ends at once, answered with ``FAKE_ACP_ANSWER`` (an assistant row)
or, without it, with no answer recorded (what a model's empty reply or a provider error
leaves). ``FAKE_ACP_BIG_CHUNK`` (characters): a prompt sends one message chunk that long and
ends (the reader's bound, docs/mnote-client.md §Sizes of events)."""
import asyncio
import os
import sys
import uuid
from pathlib import Path

import acp
from acp import update_agent_message_text
from acp.schema import AgentCapabilities, InitializeResponse, NewSessionResponse, PromptResponse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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
        sid = str(uuid.uuid4())
        if _home():
            from hermes_record import start_session
            start_session(_home(), sid, source="acp")
        return NewSessionResponse(session_id=sid)

    async def load_session(self, cwd, session_id, mcp_servers=None, **_kw):
        _log(f"load {session_id}")
        await asyncio.sleep(float(os.environ.get("FAKE_ACP_LOAD_DELAY", "0")))
        return None

    async def prompt(self, prompt, session_id, **_kw):
        big = int(os.environ.get("FAKE_ACP_BIG_CHUNK", "0"))
        if big:                  # one message chunk of that many characters (a forged one)
            await self.conn.session_update(session_id, update_agent_message_text("x" * big))
            return PromptResponse(stop_reason="end_turn")
        pieces = [p for p in os.environ.get("FAKE_ACP_STREAM", "").split("|") if p]
        if not pieces:
            if _home():                # a turn Hermes answered with FAKE_ACP_ANSWER, or not at all
                from hermes_record import append_message
                append_message(_home(), session_id, "user", prompt[0].text)
                if os.environ.get("FAKE_ACP_ANSWER"):
                    append_message(_home(), session_id, "assistant",
                                   os.environ["FAKE_ACP_ANSWER"], finish_reason="stop")
            return PromptResponse(stop_reason="end_turn")
        _log(f"prompt {session_id}")
        if _home():
            from hermes_record import append_message
            append_message(_home(), session_id, "user", prompt[0].text)
        self.cancelled = asyncio.Event()
        streamed = ""
        for piece in pieces:
            await self.conn.session_update(session_id, update_agent_message_text(piece))
            streamed += piece
            _log(f"piece {piece}")
            await asyncio.sleep(float(os.environ.get("FAKE_ACP_PIECE_DELAY", "0.05")))
        await self.cancelled.wait()
        if os.environ.get("FAKE_ACP_CANCEL", "honour") == "ignore":
            await asyncio.Event().wait()           # never ends
        if _home():
            from hermes_record import append_message
            append_message(_home(), session_id, "assistant", streamed)
        return PromptResponse(stop_reason="cancelled")

    async def cancel(self, session_id, **_kw):
        _log(f"cancel {session_id}")
        if getattr(self, "cancelled", None) is not None:
            self.cancelled.set()
        return None


def _home():
    return Path(os.environ["HERMES_HOME"]) if os.environ.get("HERMES_HOME") else None


if __name__ == "__main__":
    sys.exit(asyncio.run(acp.run_agent(FakeAgent())))

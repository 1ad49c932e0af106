"""Where one running prompt's updates go (docs/runners.md §The ACP runner): answer deltas that
add up to the recorded answer, a first chunk held while it could be Hermes's error text,
the tool calls still running, the stall watchdog's clock and the turn's questions."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..answer_text import AnswerText
from ..protocol import Questions, TurnListener

FIRST_CHUNK_HOLD = 0.2        # the longest the first message chunk waits for a second one (s)
#: How the text Hermes 0.19.0 sends in place of an answer begins — provider errors and its own
#: hints, one chunk at the end of a turn (``agent/conversation_loop.py`` ``final_response``
#: values, ``acp_adapter/server.py`` ``Error: {e}``; measured: ``HTTP 401: …``, ``API call
#: failed after 1 retries: HTTP 429: …``, ``⚠️ No reply: …``). Only a first chunk that could
#: be the start of one of them is held back (:meth:`Sink.message`); re-read on a new pin.
ERROR_TEXT_STARTS = (
    "HTTP ", "API call failed", "Error", "⚠", "Billing or credits", "Invalid API response",
    "I apologize, but I encountered", "Request payload too large", "Context length exceeded",
    "Response truncated", "First response truncated", "Operation interrupted",
    "Model generated invalid tool call", "Incomplete REASONING_SCRATCHPAD",
    "Codex response remained", "(empty)", "Failed", "No ", "Connection", "Provider",
    "Rate limit", "Authentication", "Unauthorized", "Request timed out", "Timeout",
)


def could_be_error_text(text: str) -> bool:
    """Could a first message chunk be (the start of) Hermes's error text instead of an answer
    (:data:`ERROR_TEXT_STARTS`)? A chunk shorter than a prefix counts when it starts one."""
    head = text.lstrip()
    if not head:
        return True
    return any(head.startswith(p) or p.startswith(head) for p in ERROR_TEXT_STARTS)


@dataclass
class Sink:
    """Where one running prompt's updates go."""
    listener: TurnListener | None
    last_activity: float = field(default_factory=time.monotonic)
    held: str | None = None          # the first message chunk, until a second one arrives
    delivered: int = 0               # deltas handed to the listener
    answer: AnswerText = field(default_factory=AnswerText)   # the deltas, adding up to the answer
    text: list[str] = field(default_factory=list)   # every message chunk (failure reasons)
    tools_running: dict[str, tuple | None] = field(default_factory=dict)  # call id -> (name,
    #                    preview), or None for a tool its family reports (own_tool_prefix)
    kill_reason: str | None = None
    ended: bool = False              # the prompt has answered: the runner decides what is shown
    approvals: Questions | None = None   # who answers Hermes's questions (TurnRequest.approvals)
    asking: int = 0                  # questions waiting for a human now (no stall meanwhile)
    #: the process's launch and its model calls before the prompt (the turn's calls follow)
    calls_from: tuple = (None, 0)
    _timer: asyncio.TimerHandle | None = None

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def message(self, text: str) -> None:
        self.text.append(text)
        if not self.delivered and self.held is None and could_be_error_text(text):
            self.held = text
            # a turn's error text comes alone, right before the prompt's answer; a real
            # first piece is followed by more, or the turn keeps going past the hold
            self._timer = asyncio.get_running_loop().call_later(FIRST_CHUNK_HOLD, self._hold_over)
            return
        self.release()
        self._deliver(text)

    def _hold_over(self) -> None:
        if not self.ended:
            self.release()

    def release(self) -> None:
        """Hand the held first chunk over (a second chunk arrived, the hold is over, or the
        turn answered)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.held is not None:
            held, self.held = self.held, None
            self._deliver(held)

    @property
    def shown(self) -> str:
        """The answer text handed to the listener (kept when the turn is stopped)."""
        return self.answer.text

    def tool_call(self) -> None:
        """The model called a tool: what it wrote before is one piece of the answer."""
        self.release()
        self.answer.tool_call()

    def _deliver(self, text: str) -> None:
        if self.listener is not None:
            self._send(self.answer.feed(text))

    def complete(self, answer: str) -> None:
        """The turn answered ``answer`` (its record): send what the deltas lack of it."""
        if self.listener is not None and self.delivered:
            self._send(self.answer.rest(answer))

    def close_tools(self) -> None:
        """The prompt is over: a call Hermes never reported ended gets its ``tool.completed``
        now, ``ok`` unknown (None), so that every reported start has an end."""
        running, self.tools_running = self.tools_running, {}
        for call_id, tool in running.items():
            if tool is not None and self.listener is not None:
                self.listener.tool("tool.completed", call_id, tool[0], None, tool[1])

    def _send(self, delta: str) -> None:
        if delta and self.listener is not None:
            self.delivered += 1
            self.listener.delta(delta)


class Handle:
    """What a turn's listener gets from :meth:`TurnListener.started` on the ACP runner:
    ``touch()`` feeds the stall watchdog, ``kill(reason)`` asks the turn to end."""

    def __init__(self, sink: Sink):
        self._sink = sink

    def touch(self) -> None:
        self._sink.touch()

    def kill(self, reason: str) -> None:
        self._sink.kill_reason = self._sink.kill_reason or reason

"""Streamed answer text that adds up to the recorded answer (docs/mnote-client.md §Events).

Hermes 0.19.0 streams what the model writes as it comes (``run_agent._fire_stream_delta``):
the text of each model message, and after tool calls a paragraph break (``"\\n\\n"``) before
the next text — even when nothing was shown before it. What it records is each message
stripped of surrounding whitespace; the service's answer is the turn's pieces of text — the
text of each tool-call step, then the final answer — stripped and joined with that break
(:func:`hermes_service.homes.transcript.said`). :class:`AnswerText` turns the streamed chunks
into deltas whose concatenation is exactly that: whitespace at the start of a piece is dropped,
whitespace at its end is held until more text of the same piece follows (dropped when a tool
call or the end comes first), and the break is the service's own, put between two pieces
that both have text.
"""
from __future__ import annotations

from ..homes.transcript import TOOL_BREAK


class AnswerText:
    """The deltas of one turn. :meth:`feed` a streamed chunk, get the delta to send ("" for
    none); :meth:`tool_call` when the model called a tool (a new piece begins);
    :attr:`text` is everything handed out so far."""

    def __init__(self) -> None:
        self.text = ""
        self._held = ""            # whitespace at the end of the piece, not handed out yet
        self._in_piece = False     # the current piece has handed out text

    def feed(self, chunk: str) -> str:
        if not self._in_piece:
            chunk = chunk.lstrip()
            if not chunk:
                return ""
            head = TOOL_BREAK if self.text else ""
            self._in_piece = True
        else:
            head = self._held
        body = chunk.rstrip()
        if not body:
            self._held = head + chunk
            return ""
        self._held = chunk[len(body):]
        delta = head + body
        self.text += delta
        return delta

    def tool_call(self) -> None:
        """The model called a tool: the current piece ends (its trailing whitespace is
        dropped, as Hermes's record strips it)."""
        self._in_piece = False
        self._held = ""

    def rest(self, answer: str) -> str:
        """What the deltas still lack of the recorded ``answer`` when they are a beginning of
        it (Hermes did not stream the end: e.g. a provider that answered without streaming),
        else "" (they differ: docs/mnote-client.md §Events says where)."""
        if answer.startswith(self.text) and len(answer) > len(self.text):
            rest = answer[len(self.text):]
            self.text = answer
            self._in_piece = True
            self._held = ""
            return rest
        return ""

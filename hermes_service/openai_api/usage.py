"""A turn's ``usage`` as the model pass-through counted it (docs/openai-api.md §Routes).

Hermes's per-session token counters (:func:`~hermes_service.homes.hermes_state.tokens_used`)
give the split into prompt and completion tokens, but they live in the user's ``state.db``,
which the agent in the sandbox can write: they are attacker input. The pass-through's own
count of the user's tokens (:class:`~hermes_service.model_proxy.usage.UsageStore`, what the
daily budget is kept with) bounds them: :class:`PassThroughCount` takes the user's count
before the turn and :meth:`~PassThroughCount.bound` caps the counters' numbers at what the
pass-through saw meanwhile — prompt tokens first, completion tokens from the rest; counters
that show nothing (or that the agent zeroed) give way to the pass-through's total, reported as
prompt tokens. Another turn of the same user at the same time (another route family) counts
in the pass-through's figure: the bound is looser then, never below the truth.
"""
from __future__ import annotations

import logging
import sqlite3
import time

from ..model_proxy.usage import today

log = logging.getLogger("hermes_service.openai")
#: how long a finished turn waits for the pass-through to count its last model request (the
#: relay counts it right after the answer's last byte; Hermes records the turn after that)
SETTLE_SECONDS = 1.0


class PassThroughCount:
    """The pass-through's count of ``user``'s tokens, from now on (``usage``: the
    pass-through's :class:`~hermes_service.model_proxy.usage.UsageStore`)."""

    def __init__(self, usage, user: str):
        self.usage, self.user, self.day = usage, user, today()
        self.start = self._spent(self.day)

    def _spent(self, day: str) -> int | None:
        try:
            return int(self.usage.spent(self.user, day))
        except (sqlite3.Error, OSError) as err:
            log.warning("openai usage: the pass-through's count of %s is unreadable (%s): "
                        "the turn's usage is Hermes's own", self.user, err)
            return None

    def since(self) -> int | None:
        """Tokens the pass-through counted for the user since this object was made (None:
        unknown)."""
        if self.start is None:
            return None
        now = self._spent(self.day)
        if now is None:
            return None
        if today() != self.day:                 # the turn ran across midnight (UTC)
            now += self._spent(today()) or 0
        return max(0, now - self.start)

    def bound(self, tokens: dict) -> dict:
        """``tokens`` (``{input_tokens, output_tokens, total_tokens}``) capped at what the
        pass-through counted meanwhile (waiting up to :data:`SETTLE_SECONDS` for its count
        to reach them); unchanged when its count is unknown."""
        deadline = time.monotonic() + SETTLE_SECONDS
        seen = self.since()
        while seen is not None and seen < tokens["total_tokens"] \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = self.since()
        return tokens if seen is None else capped(tokens, seen)


def capped(tokens: dict, seen: int) -> dict:
    """``tokens`` with their total at most ``seen`` (the pass-through's count): the prompt
    tokens first, the completion tokens from what is left; a total of 0 (counters that say
    nothing) becomes ``seen``, all prompt tokens."""
    inp, out = max(0, int(tokens["input_tokens"])), max(0, int(tokens["output_tokens"]))
    if inp + out == 0:
        inp = seen
    inp = min(inp, seen)
    out = min(out, seen - inp)
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}

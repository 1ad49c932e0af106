"""How each model call of a Hermes process ended, as the pass-through saw it (docs/sandbox.md
§How each call ended; docs/runners.md §Outcomes as they were).

The pass-through records one :class:`Call` per model request a Hermes process makes with its
credential (one credential per process: :meth:`~.proxy.ModelProxy.issue`) — how it ended,
the finish reason the provider sent, the tokens the budget counted — in a :class:`CallLog`.
A runner reads the calls of its turn (:meth:`CallLog.since` a :meth:`CallLog.position`
taken when the turn began) and sums them in a :class:`TurnCalls`: the turn's usage (the same
numbers the day's usage rows, ``/metrics`` and the budget got) and whether the provider's
answer came whole. Standard library only; bounded (:data:`MAX_PROCESSES` credentials of
:data:`MAX_CALLS` calls each): a hostile agent making endless calls overwrites its own oldest
entries, nothing more.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

MAX_PROCESSES = 4096     # credentials whose calls are kept (the oldest go first)
MAX_CALLS = 256          # calls kept per credential (the oldest go first)
SETTLE_SECONDS = 2.0     # at most this long a reader waits for calls still being relayed

#: how a call ended: the provider's answer came whole; broke off before its end (the
#: connection lost, the body shorter than it said, or a stream without a finish reason);
#: the provider answered an error status, or could not be reached / timed out; the caller
#: (Hermes) left before the answer's end
ENDINGS = ("complete", "broken", "error", "abandoned")


@dataclass(frozen=True)
class Call:
    """One model request: ``ended`` (one of :data:`ENDINGS`), ``status`` (the provider's HTTP
    status, or the pass-through's own 502/504), ``stream`` (an event stream was asked for),
    ``finish_reason`` (the provider's last one, or None), the tokens counted and whether they
    are the pass-through's estimate (the provider reported none), and when it ``started``."""
    ended: str
    status: int | None
    stream: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    estimated: bool
    #: when the request came (``time.monotonic()``): a turn's calls in the order Hermes made
    #: them, whatever order their relays ended in
    started: float = 0.0


def credential_key(credential: str) -> bytes:
    """The key a credential's calls are kept under (its SHA-256; the credential itself is
    kept nowhere)."""
    return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).digest()


class CallLog:
    """The calls of each credential (see the module doc); thread-safe."""

    def __init__(self, max_processes: int = MAX_PROCESSES, max_calls: int = MAX_CALLS):
        self._lock = threading.Condition()
        self._busy: dict[bytes, int] = {}        # calls being relayed now, per credential
        self._calls: collections.OrderedDict[bytes, tuple[int, collections.deque]] = \
            collections.OrderedDict()
        self.max_processes, self.max_calls = max_processes, max_calls

    def add(self, key: bytes, call: Call) -> None:
        """Record ``call`` of the credential ``key`` (:func:`credential_key`)."""
        with self._lock:
            held = self._calls.pop(key, None)
            count, calls = held if held is not None else (0, collections.deque(
                maxlen=self.max_calls))
            calls.append(call)
            self._calls[key] = (count + 1, calls)
            while len(self._calls) > self.max_processes:
                self._calls.popitem(last=False)

    @contextmanager
    def relaying(self, key: bytes) -> Iterator[None]:
        r"""A call of the credential ``key`` is being relayed (it is :meth:`add`\ ed before
        the block ends): :meth:`since` waits for it."""
        with self._lock:
            self._busy[key] = self._busy.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._busy.pop(key, 1) - 1
                if left > 0:
                    self._busy[key] = left
                self._lock.notify_all()

    def position(self, credential: str | None, settle: float = SETTLE_SECONDS) -> int:
        """How many calls the credential made so far (0 for None or an unknown one), once
        the calls being relayed have ended (at most ``settle`` seconds; 0: at once)."""
        if not credential:
            return 0
        key = credential_key(credential)
        with self._lock:
            if settle > 0:
                self._lock.wait_for(lambda: not self._busy.get(key), settle)
            held = self._calls.get(key)
            return held[0] if held is not None else 0

    def since(self, credential: str | None, position: int = 0,
              settle: float = SETTLE_SECONDS) -> list[Call]:
        """The calls the credential made after :meth:`position` gave ``position`` (those
        still kept: at most :data:`MAX_CALLS`), once the calls being relayed have ended (at
        most ``settle`` seconds: the relay records a call just after its last byte went to
        Hermes, which may already have acted on it)."""
        if not credential:
            return []
        key = credential_key(credential)
        with self._lock:
            self._lock.wait_for(lambda: not self._busy.get(key), settle)
            held = self._calls.get(key)
            if held is None:
                return []
            count, calls = held
            new = count - position
            return list(calls)[-new:] if new > 0 else []

    def forget(self, credential: str) -> None:
        with self._lock:
            self._calls.pop(credential_key(credential), None)


@dataclass(frozen=True)
class TurnCalls:
    """The model calls of one turn (:meth:`CallLog.since`), summed."""
    calls: tuple[Call, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.calls)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.calls)

    @property
    def estimated(self) -> bool:
        """Are some of the tokens the pass-through's estimate?"""
        return any(c.estimated for c in self.calls)

    def usage(self) -> dict:
        """The turn's usage as every reply names it: ``input_tokens``, ``output_tokens``,
        ``total_tokens``, ``estimated`` and ``requests`` (model calls)."""
        inp, out = self.prompt_tokens, self.completion_tokens
        return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
                "estimated": self.estimated, "requests": len(self.calls)}

    @property
    def last(self) -> Call | None:
        """The call that ended the turn's answer: its last streamed call (Hermes streams every
        call of a turn; its side calls — compaction, titles — are not streamed), else its
        last call."""
        streamed = [c for c in self.calls if c.stream] or list(self.calls)
        return streamed[-1] if streamed else None

    @property
    def broken(self) -> bool:
        """Did the provider's answer to the turn's last try break off (or fail)? Then the
        answer Hermes recorded is pieces of answers the provider never finished."""
        last = self.last
        return last is not None and last.ended in ("broken", "error")

    @property
    def tries(self) -> int:
        """How many calls in a row, at the end of the turn, broke off or failed."""
        n = 0
        for c in reversed([c for c in self.calls if c.stream] or self.calls):
            if c.ended not in ("broken", "error"):
                break
            n += 1
        return n

    def finish_reason(self, recorded: str | None) -> str | None:
        """The finish reason a reply names: Hermes's ``recorded`` one, except a ``length``
        the provider never sent (Hermes says ``length`` for a stream that broke off, to ask
        for a continuation): then the provider's own (None when it sent none). Without calls
        (no pass-through) ``recorded`` as is."""
        last = self.last
        if last is None or recorded != "length" or last.finish_reason == "length":
            return recorded
        return last.finish_reason

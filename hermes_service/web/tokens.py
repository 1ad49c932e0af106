"""Random hex tokens of the per-request ids (``req_…`` request ids, ``trace_…`` trace ids).

:func:`hex16` gives what ``secrets.token_hex(8)`` gives — 16 hex digits of the OS's random
source — but draws 256 at a time: each draw is a ``getrandom`` call, which gives up the GIL,
and one per request was a thread hand-off per request under load (docs/benchmarks.md,
request cost). Ids that guard something (run tokens, credentials, run and question ids) keep
calling :mod:`secrets` directly.
"""
from __future__ import annotations

import os
from collections import deque

_POOL: deque[str] = deque()
_BATCH = 256
os.register_at_fork(after_in_child=_POOL.clear)   # a forked child never repeats its parent's


def hex16() -> str:
    """16 lowercase hex digits (64 random bits). Thread-safe without a lock: ``deque`` pops
    are atomic, and two threads refilling at once only draw more."""
    while True:
        try:
            return _POOL.popleft()
        except IndexError:
            raw = os.urandom(8 * _BATCH).hex()
            _POOL.extend([raw[i:i + 16] for i in range(0, len(raw), 16)])

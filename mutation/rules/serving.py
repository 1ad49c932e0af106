"""Group ``serving``: waitress's options (lifecycle.waitress_options) and the counting limit
of slots and admission (limits.py)."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="serving")
LC = "hermes_service/lifecycle.py"
LM = "hermes_service/limits.py"
WAITRESS = ["tests/unit/test_serving_rules.py"]
LIMITS = ["tests/unit/test_limits.py", "tests/unit/test_serving_rules.py"]

MUTANTS = [
    H("waitress drops X-Forwarded-For (the allowlist judges the proxy)", LC,
      '"clear_untrusted_proxy_headers": False,', '"clear_untrusted_proxy_headers": True,', WAITRESS),
    H("a body of exactly max_body_bytes is refused", LC,
      '"max_request_body_size": svc.max_body_bytes + 1,', '"max_request_body_size": svc.max_body_bytes,',
      WAITRESS),
    H("no body cap in waitress", LC, '"max_request_body_size": svc.max_body_bytes + 1,', "", WAITRESS),
    H("no connection limit", LC, '"connection_limit": svc.connection_limit,', "", WAITRESS),
    H("idle connections kept twice as long", LC, '"channel_timeout": idle,', '"channel_timeout": idle * 2,',
      WAITRESS),
    H("no request lookahead (a closed stream unseen)", LC, '"channel_request_lookahead": 1,',
      '"channel_request_lookahead": 0,', WAITRESS),
    H("select() instead of poll()", LC, '"asyncore_use_poll": True,', '"asyncore_use_poll": False,',
      WAITRESS),
    H("the threads asked for are ignored", LC, '"threads": threads or svc.threads,',
      '"threads": svc.threads,', WAITRESS),
    H("the limiter takes one place more than its size", LM, "            while self._held >= self._size:",
      "            while self._held > self._size:", LIMITS),
    H("a release without a hold passes", LM,
      '            if self._held <= 0:\n                raise ValueError("Limiter released too many times")\n',
      "", LIMITS),
    H("a release wakes no waiter", LM, "            self._held -= 1\n            self._cond.notify()\n",
      "            self._held -= 1\n", LIMITS),
    H("a growing resize wakes no waiter", LM, "            self._size = size\n            self._cond.notify_all()\n",
      "            self._size = size\n", LIMITS),
    H("a non-blocking acquire waits", LM, "                if not blocking:\n                    return False\n",
      "", LIMITS),
]

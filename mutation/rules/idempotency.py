"""Group ``idempotency``: the ``Idempotency-Key`` rules (idempotency.py) and their route
wrapper (web.idempotent)."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="idempotency")
I = "hermes_service/idempotency.py"
W = "hermes_service/web/helpers.py"
RULES = ["tests/unit/test_idempotency_rules.py"]
ROUTES = ["tests/unit/test_idempotency.py"]

MUTANTS = [
    H("a 5xx is recorded and replayed", I, "return status < 400 or status in RECORDED_4XX",
      "return status < 400 or status in RECORDED_4XX or status >= 500", RULES),
    H("every 4xx is recorded (a refusal replayed to a retry)", I,
      "return status < 400 or status in RECORDED_4XX", "return status < 500", RULES),
    H("a turn ended by its limit (422) is not recorded", I,
      "return status < 400 or status in RECORDED_4XX", "return status < 400", RULES),
    H("a 429 is recorded", I, "RECORDED_4XX = frozenset({422})",
      "RECORDED_4XX = frozenset({422, 429})", RULES),
    H("a busy session's 409 is recorded", I, "RECORDED_4XX = frozenset({422})",
      "RECORDED_4XX = frozenset({422, 409})", RULES),
    H("an empty key is accepted", I, '_KEY = re.compile(r"[!-~]{1,%d}"',
      '_KEY = re.compile(r"[!-~]{0,%d}"', RULES),
    H("a space in a key is accepted", I, '_KEY = re.compile(r"[!-~]{1,%d}"',
      '_KEY = re.compile(r"[ -~]{1,%d}"', RULES),
    H("a 256-character key is accepted", I, "MAX_KEY_LENGTH = 255", "MAX_KEY_LENGTH = 256", RULES),
    H("the key is searched, not matched whole", I, "if not _KEY.fullmatch(value):",
      "if not _KEY.match(value):", RULES),
    H("a live record is taken over once it expired", I,
      "if expires <= now and not live:", "if expires <= now:", RULES),
    H("a record expires one second late", I,
      "if expires <= now and not live:", "if expires < now and not live:", RULES),
    H("another live process's record is taken over", I,
      'live = state == "running" and (owner == me or instance.alive(owner))',
      'live = state == "running" and owner == me', RULES),
    H("a dead process's record is never taken over", I,
      'live = state == "running" and (owner == me or instance.alive(owner))',
      'live = state == "running"', RULES),
    H("another fingerprint is replayed (no conflict)", I, "elif fp_old != fp:", "elif False:",
      RULES),
    H("a finished record is run again", I,
      "                elif state == \"done\":\n", "                elif False:\n", RULES),
    H("a taken-over record keeps its dead owner", I,
      'con.execute("UPDATE requests SET owner = ?, expires_at = ? WHERE scope = ? "\n'
      '                                "AND idem_key = ?", (me, now + self.ttl, scope, key))',
      "pass", RULES),
    H("a finished outcome expires at once", I,
      "(outcome.status, outcome.content_type, outcome.body, now + self.ttl, scope, key,",
      "(outcome.status, outcome.content_type, outcome.body, now, scope, key,", RULES),
    H("finish writes another process's claim", I,
      "\"expires_at = ? WHERE scope = ? AND idem_key = ? AND owner = ? AND state = 'running'\",",
      "\"expires_at = ? WHERE scope = ? AND idem_key = ? AND ? IS NOT NULL AND state = 'running'\",",
      RULES),
    H("release drops another process's claim", I,
      '"owner = ? AND state = \'running\'", (scope, key, instance.current()))',
      '"? IS NOT NULL AND state = \'running\'", (scope, key, instance.current()))', RULES),
    H("prune deletes a live claim", I, 'if state == "done" or not instance.alive(owner)]',
      "if True]", RULES),
    H("prune deletes nothing expired in progress", I,
      'if state == "done" or not instance.alive(owner)]', 'if state == "done"]', RULES),
    H("PRAGMA synchronous=NORMAL", I, 'con.execute("PRAGMA synchronous=FULL")',
      'con.execute("PRAGMA synchronous=NORMAL")', RULES),
    H("no WAL journal", I, 'con.execute("PRAGMA journal_mode=WAL")',
      'con.execute("PRAGMA journal_mode=DELETE")', RULES),
    H("the busy timeout in seconds, not milliseconds", I,
      'con.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")',
      'con.execute(f"PRAGMA busy_timeout={int(self.busy_timeout)}")', RULES),
    H("a claim is a deferred transaction", I, '        con.execute("BEGIN IMMEDIATE")\n        try:\n'
      '            row = con.execute(', '        con.execute("BEGIN")\n        try:\n'
      '            row = con.execute(', RULES),
    # -- the route wrapper ---------------------------------------------------------------
    H("a request that raised keeps its claim (the key is stuck running)", W,
      "        store.release(scope, key)     # e.g. 413 or an internal error: not replayed\n",
      "        pass\n", RULES),
    H("an unrecorded outcome keeps its claim", W,
      "        else:\n            store.release(scope, key)\n",
      "        else:\n            pass\n", ROUTES),
    H("an outcome is recorded without the recordable rule", W,
      "if recordable(resp.status_code, code) and not resp.is_streamed:",
      "if not resp.is_streamed:", ROUTES),
    H("a waiting retry replays without waiting (503 at once)", W,
      "        store.wait(POLL_SECONDS)\n", "        break\n", ROUTES),
]

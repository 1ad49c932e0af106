"""Hand-made mutants (docs/testing.md §Mutation testing), run by ``mutation/run.py`` (alone:
``make mutation MUTATION_ARGS=--hand-only``).

Two kinds, each a one-line (or one-statement) change that the tests named with it must fail:

* the mutations a review found surviving the fast suite, kept as a regression
  list: each is killed by a test written for it;
* changes mutmut cannot make: it never mutates a decorated function (Flask routes, context
  managers such as the session turn lock, the store's transactions and the shard lock).

A mutant with ``repeat`` > 1 must be killed on every run (a test that catches it only
sometimes is not enough). Every mutant's tests first run unmutated and must pass.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Hand:
    name: str            # what the mutation does
    path: str            # repo-relative file
    old: str             # a unique substring of that file ...
    new: str             # ... replaced by this
    tests: list[str]     # pytest arguments selecting the tests that must fail
    repeat: int = 1
    group: str = "review"    # the module group it counts in (docs/testing.md, the table)


SEC = "tests/unit/test_security.py"
TOOLS = "tests/unit/mnote/test_tool_endpoint.py"
STORE = "tests/unit/test_session_store.py"
CLIENT = "tests/unit/mnote/test_client.py"
TURNS = "tests/unit/test_turns.py"

MUTANTS = [
    # -- the review's survivors ------------------------------------------------------------
    Hand("a key bound to an actor may post into another user's v1 session via user_context",
         "hermes_service/web/api_v1.py",
         "    owner = _user(ctx_user)  ",
         "    owner = ctx_user or _user(None)  ",
         [f"{SEC}::test_key_bound_to_an_actor_cannot_post_into_another_users_session_via_user_context"]),
    Hand("a run ignores its key's capability scope (always the configured default)",
         "hermes_service/mnote/client_runs.py",
         "                scope=capability_scope(svc),\n",
         "                scope=list(settings(svc.config).default_capability_scope),\n",
         [f"{TOOLS}::test_a_keys_capability_scope_binds_the_runs_it_starts"]),
    Hand("the gateway accepts the envelope's (wider) capability scope",
         "hermes_service/mnote/gateway.py",
         '"capabilityScope": list(claims.capability_scope)}',
         '"capabilityScope": envelope.get("capabilityScope", list(claims.capability_scope))}',
         [f"{TOOLS}::test_a_keys_capability_scope_binds_the_runs_it_starts"]),
    Hand("bearer mode accepts any Authorization scheme",
         "hermes_service/security.py",
         'scheme.lower() == "bearer" and token.strip()',
         'token.strip()',
         [f"{SEC}::test_bearer_mode_accepts_only_the_bearer_scheme"]),
    Hand("X-Forwarded-For: the rightmost hop, trusted or not",
         "hermes_service/security.py",
         "            if not _in(hop_addr, self.trusted):\n",
         "            if True:\n",
         [f"{SEC}::test_forwarded_for_behind_an_allowed_trusted_proxy"]),
    Hand("X-Forwarded-For: a garbled chain falls back to the (allowed) proxy",
         "hermes_service/security.py",
         "                return None   # a garbled chain is not trusted\n",
         "                continue\n",
         [f"{SEC}::test_forwarded_for_behind_an_allowed_trusted_proxy"]),
    Hand("a killed first turn is not matched to its Hermes session by the turn marker",
         "hermes_service/runner/cli.py",
         "sid = session_id_from_stderr(outcome.stderr) \\\n"
         "                or _read_marker(marker, self.processes.run_files)\n",
         "sid = session_id_from_stderr(outcome.stderr)\n",
         [TURNS]),
    Hand("a failed turn that Hermes kept is not mapped to the session",
         "hermes_service/conversations.py",
         "            self.store.update(session_id, hermes_session_id=saved)\n",
         "            pass\n",
         [TURNS]),
    Hand("the page-context cap is 10x larger",
         "hermes_service/mnote/page_context.py",
         "CONTEXT_BUDGET = 8192 ",
         "CONTEXT_BUDGET = 81920 ",
         [f"{CLIENT}::test_page_context_is_really_capped"]),
    Hand("the page context drops no whole field",
         "hermes_service/mnote/page_context.py",
         "            ctx.pop(key, None)\n",
         "            pass\n",
         [f"{CLIENT}::test_page_context_is_really_capped"]),
    Hand("the page context cuts long texts before the outline",
         "hermes_service/mnote/page_context.py",
         "    while size() > CONTEXT_BUDGET and ctx.get(\"outline\"):  # 1. the outline, halving\n",
         "    while False:\n",
         [f"{CLIENT}::test_page_context_keeps_what_fits_and_cuts_in_order"]),
    Hand("the turn lock holds within one process only (no file lock)",
         "hermes_service/conversations.py",
         "                flock.acquire()\n",
         "                pass\n",
         [TURNS]),
    Hand("a shard is written in place (not temp file + rename)",
         "hermes_service/files.py",
         '    payload = data.encode("utf-8") if isinstance(data, str) else data\n',
         '    payload = data.encode("utf-8") if isinstance(data, str) else data\n'
         '    path.write_bytes(payload)\n    return path\n',
         [f"{STORE}::test_kill_9_during_writes_keeps_every_acknowledged_change",
          f"{STORE}::test_a_writer_killed_inside_a_shard_write_keeps_every_acknowledged_change"],
         repeat=5),
    # -- what mutmut cannot reach (decorated functions) --------------------------------------
    Hand("tool endpoint: a refused call is answered 200",
         "hermes_service/mnote/endpoint.py",
         "        resp.status_code = exc.status\n",
         "        pass\n",
         [TOOLS]),
    Hand("tool endpoint: a refusal does not echo the caller's envelope",
         "hermes_service/mnote/endpoint.py",
         "failure_envelope(exc.code, exc.message, envelope)",
         "failure_envelope(exc.code, exc.message, None)",
         [TOOLS]),
    Hand("session registry: the shard lock is a thread lock only (no file lock)",
         "hermes_service/session_store.py",
         '                FileLock(str(shard) + ".lock", timeout=self.lock_timeout, poll_interval=0.005):',
         '                threading.Lock():',
         [f"{STORE}::test_concurrent_creates_and_updates_from_two_processes_lose_nothing"]),
    Hand("page store: a failed write command leaves its transaction open",
         "hermes_service/mnote/page_sqlite.py",
         "            if con.in_transaction:\n                con.execute(\"ROLLBACK\")\n",
         "            pass\n",
         ["tests/unit/mnote/test_page_store.py"]),
    Hand("page store: a write command is never committed",
         "hermes_service/mnote/page_sqlite.py",
         'con.execute("COMMIT" if write else "ROLLBACK")',
         'con.execute("ROLLBACK")',
         ["tests/unit/mnote/test_page_store.py"]),
    Hand("turn lock: a busy session is waited for without a bound",
         "hermes_service/conversations.py",
         'flock = FileLock(str(self.locks_dir / f"session-{session_id}.lock"), timeout=wait)',
         'flock = FileLock(str(self.locks_dir / f"session-{session_id}.lock"), timeout=-1)',
         [TURNS]),
]


#: A fork server: imports pytest and the third-party libraries once (never the package, which
#: each run imports afresh from the mutated copy), then forks a child per pytest run. It
#: halves the CPU a hand mutant costs (the imports were half of a small selection's run).
_ZYGOTE = r"""
import json, os, signal, sys
import pytest, xdist, flask, werkzeug, waitress, jsonschema, yaml, filelock, requests
import prometheus_client, sqlite3, http.client, asyncio, hypothesis
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.chdir(req["cwd"])
        sys.path.insert(0, req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        signal.alarm(req["timeout"])         # a mutant that hangs its tests: SIGALRM
        os._exit(int(pytest.main(req["args"])))
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


#: seconds one run of a selection may take; a mutant whose tests hang past it is detected
#: (a timeout, like mutmut's), its tests killed by SIGALRM
TIMEOUT = 120
TIMED_OUT = -14


class _Forks:
    """The fork server of one run (:data:`_ZYGOTE`)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, dest: Path, env: dict, args: list[str]) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], cwd="/", env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cwd": str(dest), "env": env, "args": args,
                                          "timeout": TIMEOUT}) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()          # type: ignore[union-attr]
            self.proc.wait()


_FORKS = _Forks()


def _pytest(dest: Path, env: dict, tests: list[str]) -> int:
    return _FORKS.run(dest, env, ["-q", "-x", "-p", "no:cacheprovider", "-m", "not e2e", *tests])


def all_mutants() -> list[Hand]:
    """:data:`MUTANTS` and those of every module group of :mod:`mutation.rules`."""
    from mutation.rules import MUTANTS as RULES
    return [*MUTANTS, *RULES]


def groups() -> list[str]:
    return sorted({m.group for m in all_mutants()})


def verdicts(log: Path) -> dict[str, bool]:
    """Verdicts of hand mutants in the printed output of an earlier run (``--resume``): name
    -> killed. A run cut short is resumed without running again what it decided."""
    out = {}
    for line in log.read_text("utf-8").splitlines():
        for mark, killed in (("   killed   [", True), ("   SURVIVED [", False)):
            if line.startswith(mark):
                name = line[len(mark):].split("] ", 1)[1]
                name = name.split(" (", 1)[0] if killed else name.split(": pytest exit", 1)[0]
                out[name] = killed
    return out


def run_all(dest: Path, copy_tree, make_env, only: list[str] | None = None,
            resume: dict[str, bool] | None = None) -> list[dict]:
    """Apply each hand mutant (:func:`all_mutants`; of the groups ``only`` when given) in a
    fresh copy of the work tree at ``dest``, run its tests, restore the file. Each distinct
    selection first runs once unmutated and must pass. Returns ``[{name, group, path,
    killed, runs, note, seconds}]`` and prints a line per mutant."""
    copy_tree(dest)
    env = make_env(dest)
    chosen = [m for m in all_mutants() if not only or m.group in only]
    print(f"== hand-made mutants: {len(chosen)}", flush=True)
    out = []
    clean: dict[tuple, bool] = {}      # selection -> passes unmutated
    for m in chosen:
        if resume and m.name in resume:
            killed = resume[m.name]
            print(f"   {'killed  ' if killed else 'SURVIVED'} [{m.group}] {m.name}"
                  + ("" if killed else ": pytest exit codes [0] (an earlier run)"), flush=True)
            out.append({"name": m.name, "group": m.group, "path": m.path, "killed": killed,
                        "runs": [1 if killed else 0], "note": "" if killed else "earlier run",
                        "seconds": 0.0})
            continue
        started = time.monotonic()
        path = dest / m.path
        original = path.read_text("utf-8")
        note, codes = "", []
        key = tuple(m.tests)
        if original.count(m.old) != 1:
            note = f"the text to change occurs {original.count(m.old)} times (not once)"
        elif not clean.setdefault(key, _pytest(dest, env, m.tests) == 0):
            note = "its tests fail without the mutation"
        else:
            path.write_text(original.replace(m.old, m.new), "utf-8")
            try:
                codes = [_pytest(dest, env, m.tests) for _ in range(m.repeat)]
            finally:
                path.write_text(original, "utf-8")
            if any(c not in (1, TIMED_OUT) for c in codes):
                note = f"pytest exit codes {codes} (1 = a test failed)"
        killed = not note
        print(f"   {'killed  ' if killed else 'SURVIVED'} [{m.group}] {m.name}"
              + (f" ({len(codes)}/{m.repeat} runs)" if m.repeat > 1 and killed else "")
              + (f": {note}" if note else ""), flush=True)
        out.append({"name": m.name, "group": m.group, "path": m.path, "killed": killed,
                    "runs": codes, "note": note, "seconds": round(time.monotonic() - started, 1)})
    _FORKS.close()
    return out


"""The ACP runner's process pool under concurrency (docs/runners.md, §The ACP runner
in detail), against ``tests/support/fake_acp_agent.py`` — a real Agent Client Protocol agent that
starts in a fraction of a second — instead of ``hermes acp`` (1-3 s of start-up each), so
the interleavings are deterministic and cheap. Every wait is for a condition (the process
ready, the turn waiting in ``session/new``, a request the agent received: :func:`wait_for`),
bounded by :data:`WAIT` so that a loaded machine only makes a test slower, never failing.

Found by the pre-ship review: with ``hermes.acp.max_processes`` reached and several users
at once, a user's turn could evict a process another turn was starting or was about to
prompt (InvalidStateError -> ``hermes_failed``; or the turn waited forever on the killed
process's ``session/new``, holding a turn slot and the session, deaf to abort), two turns of
one user could start two processes (one untracked: above the cap, never closed), and a
killed process's pending requests never returned.
"""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hermes_service.errors import RunError
from hermes_service.installed import build_config
from hermes_service.runner import Processes, UseCli
from hermes_service.runner.acp import AcpRunner
from hermes_service.sandbox import Launch
from support.fixtures import base_config, deep_merge, wait_for

AGENT = Path(__file__).parents[2] / "support" / "fake_acp_agent.py"
#: the bound of every wait here: a process start takes ~0.3 s idle, several s on a loaded machine
WAIT = 60


@pytest.fixture
def pool(tmp_path):
    made = []

    def make(max_processes=1, new_session_delay=0.0):
        cfg = build_config(deep_merge(base_config(tmp_path), {
            "hermes": {"command": str(AGENT), "runner": "acp",
                       "acp": {"max_processes": max_processes, "start_timeout_seconds": WAIT}}}))
        h = cfg.hermes
        # a replacement's home and environment, as the composition root's: the ones in force
        runner = AcpRunner(h, Processes(h, pid_dir=tmp_path / "pids", run_dir=tmp_path / "runs"),
                           lambda user: (home(tmp_path, user), dict(runner.env)))
        runner.env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path),
                      "FAKE_ACP_NEW_SESSION_DELAY": str(new_session_delay),
                      "FAKE_ACP_LOG": str(tmp_path / f"agent-{len(made)}.log")}
        runner.hermes_settings = h    # what a reload of the same file hands over
        made.append(runner)
        return runner
    yield make
    for runner in made:
        runner.close()
    # the runners, their stopped loops and the killed agents' pipe transports are garbage in
    # cycles: collect them now. Left to a later collection they are finalised at a random
    # moment (a transport finalised after its loop: "Event loop is closed"), once in pytest's
    # own ast.parse, which CPython 3.11 then failed with "SystemError: AST constructor
    # recursion depth mismatch" (python/cpython#106905) after every test had passed
    made.clear()
    gc.collect()


def home(tmp_path, user):
    root = tmp_path / "users" / user
    root.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(user_id=user, root=root, hermes_home=root / ".hermes")


def acquire(runner, tmp_path, user, **kw):
    """Start ``Pool.acquire`` on the runner's loop; returns its concurrent future."""
    return runner._call(runner.pool.acquire((user, "mnote"), home(tmp_path, user), runner.env, [], **kw))


def agent_log(runner, kind: str) -> list[str]:
    """The requests of ``kind`` (``new``, ``load``) the runner's fake agents received."""
    path = Path(runner.env["FAKE_ACP_LOG"])
    lines = path.read_text().splitlines() if path.exists() else []
    return [line for line in lines if line.split()[0] == kind]


def waiting_in_session_new(runner, user, family="mnote"):
    """Wait until ``user``'s turn has its process and waits for ``session/new`` (it has taken
    the process's spare session, whose ``session/new`` the agent received); returns the
    process."""
    def opening():
        proc = runner.pool.get((user, family))
        return proc if (proc is not None and proc.ready is not None and proc.ready.done()
                        and proc.reserved and proc.spare is None and agent_log(runner, "new")) \
            else None
    return wait_for(opening, f"{user}'s turn to wait in session/new")


def alive(runner):
    """pids of live fake agents started by this runner (tracked or not)."""
    with runner.processes.groups._lock:
        members = list(runner.processes.groups._live)
    return [m.pgid for m in members if m.pgid and _alive(m.pgid)]


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_starting_process_is_never_evicted_for_another_user(pool, tmp_path):
    runner = pool(max_processes=1)
    first = acquire(runner, tmp_path, "u1")
    second = acquire(runner, tmp_path, "u2")        # while u1's process is still starting
    proc = first.result(WAIT)                        # u1 gets a live process, no InvalidStateError
    assert not proc.dead and not proc.retired
    with pytest.raises(UseCli):                      # the pool is full of a starting process:
        second.result(WAIT)                          # u2's turn runs on the CLI instead
    assert len(alive(runner)) == 1


def test_two_turns_of_one_user_share_one_process(pool, tmp_path):
    runner = pool(max_processes=1)
    acquire(runner, tmp_path, "u0").result(WAIT)     # an idle process: both must evict it
    a, b = acquire(runner, tmp_path, "u1"), acquire(runner, tmp_path, "u1")
    assert a.result(WAIT) is b.result(WAIT)
    # the evicted one is reaped (a moment after its kill); no second process of u1 appears
    wait_for(lambda: len(alive(runner)) == 1, "one live agent")
    assert runner.process_count() == 1


def test_a_process_acquired_for_a_turn_is_not_idle(pool, tmp_path):
    runner = pool(max_processes=1)
    proc = acquire(runner, tmp_path, "u1", reserve=True).result(WAIT)
    with pytest.raises(UseCli):                      # not evicted between acquire and prompt
        acquire(runner, tmp_path, "u2").result(WAIT)
    assert not proc.dead and not proc.retired


def test_a_killed_process_fails_its_pending_requests(pool, tmp_path):
    runner = pool(max_processes=1, new_session_delay=3600)
    proc = acquire(runner, tmp_path, "u1").result(WAIT)
    pending = runner._call(proc.conn.new_session(cwd=str(tmp_path)))
    # the agent has it (after the spare session/new every start makes): it will never answer
    wait_for(lambda: len(agent_log(runner, "new")) == 2, "the agent to receive session/new")
    proc.kill("test")
    with pytest.raises(Exception) as err:            # ConnectionError, not a wait for ever
        pending.result(WAIT)
    assert not isinstance(err.value, TimeoutError), "the request outlived its process"


def test_a_process_closed_while_it_starts_fails_the_turn_cleanly(pool, tmp_path):
    runner = pool(max_processes=1)
    fut = acquire(runner, tmp_path, "u1")
    wait_for(lambda: runner.pool.get(("u1", "mnote")) or fut.done(), "u1's process to start")
    runner.configure(runner.hermes_settings)         # a reload retires it while it starts
    try:
        proc = fut.result(WAIT)
    except RunError as err:                          # told, not InvalidStateError
        assert err.code == "hermes_failed"
    else:
        assert not proc.dead and not proc.retired


@pytest.mark.parametrize("limit, status, code", [("home_quota", 507, "home_quota_exceeded"),
                                                  ("disk", 507, "storage_full")])
def test_a_process_the_disk_watcher_ends_while_it_starts_fails_with_its_code_not_502(
        pool, tmp_path, limit, status, code):
    """A home at its files' cap: the watcher ends the new process at its first look
    (docs/sandbox.md §A home at its quota) — the turn is 507, never 502 hermes_failed."""
    runner = pool(max_processes=1)
    runner.processes.launch = lambda args, env, home: Launch(    # its sandbox, ended at once
        ["/bin/sh", "-c", "exit 137"], env, str(home.root), over=limit)
    with pytest.raises(RunError) as err:
        acquire(runner, tmp_path, "u1").result(WAIT)
    assert (err.value.status, err.value.code) == (status, code)


def test_a_turn_ended_by_the_shutdown_says_service_stopping(pool, tmp_path):
    """SIGTERM/SIGINT during an ACP turn: the turn ends with ``service_stopping`` (v1 503,
    panel ``run.failed`` ``hermes_client_service_stopping``), as on the CLI runner — not
    ``hermes_failed`` (panel: ``hermes_client_upstream_unavailable``)."""
    import threading

    from hermes_service.runner import TurnRequest
    runner = pool(max_processes=1, new_session_delay=3600)     # the turn waits in session/new
    req = TurnRequest(message="hi", resume_id=None, home=home(tmp_path, "u1"), env=runner.env,
                      family="mnote")
    outcome = {}

    def turn():
        try:
            runner.run_turn(req)
        except RunError as err:
            outcome["code"] = err.code
    t = threading.Thread(target=turn)
    t.start()
    waiting_in_session_new(runner, "u1")
    runner.processes.stopping = True                 # what Services.shutdown() does
    runner.processes.kill_all()
    runner.close()
    t.join(WAIT)
    assert outcome.get("code") == "service_stopping"


def test_a_cli_turn_on_a_loaded_session_retires_the_warm_process(pool, tmp_path):
    """A turn for another model than hermes.model.default runs on the CLI, which continues the
    ACP session in state.db; the user's warm process still held the conversation in memory
    (Hermes reads a loaded session's history once) and answered its next turn without the CLI
    turn (the model never saw it). That process now takes no further turn."""
    from hermes_service.runner import TurnRequest
    runner = pool(max_processes=2)
    h = home(tmp_path, "u1")
    from support.hermes_record import start_session
    for sid in ("s1", "s2"):                 # two ACP sessions as Hermes records them
        start_session(h.hermes_home, sid, source="acp")
    proc = runner._call(runner.pool.acquire(("u1", "mnote"), h, runner.env, [])).result(WAIT)
    proc.sessions.add("s1")                          # a turn of s1 ran in it
    req = TurnRequest(message="hi", resume_id="s2", home=h, env=runner.env, family="mnote",
                      model="other-model")
    with pytest.raises(UseCli):                      # s2 is not loaded there: stays warm
        runner.run_turn(req)
    assert not proc.retired
    req.resume_id = "s1"
    with pytest.raises(UseCli):
        runner.run_turn(req)
    assert proc.retired and runner.pool.get(("u1", "mnote")) is not proc


def _turn_in_thread(runner, req):
    import threading
    outcome = {}

    def turn():
        try:
            runner.run_turn(req)
            outcome["code"] = "ok"
        except RunError as err:
            outcome["code"] = err.code
    t = threading.Thread(target=turn, daemon=True)
    t.start()
    return t, outcome


def test_an_abort_while_the_turn_opens_its_session_ends_it(pool, tmp_path):
    """Abort during a turn's start (process start, ``session/new``: 1.5-3 s in Hermes,
    for ever when it hangs): the turn ends as ``run_cancelled`` at once instead of going on
    to prompt the model (or waiting for ever, holding a slot and the session)."""
    import threading

    from hermes_service.runner import TurnRequest
    runner = pool(max_processes=1, new_session_delay=3600)
    cancel = threading.Event()
    req = TurnRequest(message="hi", resume_id=None, home=home(tmp_path, "u1"), env=runner.env,
                      family="mnote", cancel=cancel)
    t, outcome = _turn_in_thread(runner, req)
    # not a fixed time: a loaded machine may take longer than any guess to start the agent,
    # and an abort during the start leaves a starting process, which no turn may evict
    waiting_in_session_new(runner, "u1")
    cancel.set()
    t.join(WAIT)
    assert outcome.get("code") == "run_cancelled"
    # the process it started stays usable (not reserved: another user's turn may evict it)
    assert runner._call(runner.pool.acquire(("u2", "mnote"), home(tmp_path, "u2"), runner.env,
                                        [])).result(WAIT) is not None


def test_a_session_open_that_never_answers_is_timed_out(pool, tmp_path):
    from hermes_service.runner import TurnRequest
    runner = pool(max_processes=1, new_session_delay=3600)
    runner.processes.timeout = 2.0
    req = TurnRequest(message="hi", resume_id=None, home=home(tmp_path, "u1"), env=runner.env,
                      family="mnote")
    t, outcome = _turn_in_thread(runner, req)
    t.join(WAIT)           # the time limit ends it in session/new, or already while it starts
    assert outcome.get("code") == "run_timeout"


def test_a_session_another_process_continued_is_not_answered_from_stale_memory(pool, tmp_path):
    """Two service processes on one data dir (or a CLI turn) continue the same ACP session:
    a warm process that loaded it holds its history as of its own last turn there (Hermes
    reads a loaded session once), so its next turn there would not see the other's turns
    (seen live: [[recall]] on one service missed the turn the other had answered). A change
    of the record since its last turn there sends the turn to a fresh process."""
    from hermes_service.homes import hermes_state
    from hermes_service.runner import TurnRequest
    from hermes_service.runner.acp.sink import Sink
    from support.hermes_record import record_turn
    runner = pool(max_processes=2)
    h = home(tmp_path, "u1")
    record_turn(h.hermes_home, "s1", "one", answer="echo one")
    proc = runner._call(runner.pool.acquire(("u1", "v1"), h, runner.env, [])).result(WAIT)
    proc.sessions.add("s1")
    proc.seen["s1"] = hermes_state.fingerprint(h.hermes_home, "s1")     # its last turn there
    req = TurnRequest(message="again", resume_id="s1", home=h, env=runner.env, family="v1")

    def turn():
        now = hermes_state.fingerprint(h.hermes_home, "s1")
        return runner._call(runner.turns.run(req, Sink(None), lost=False, record=now)).result(WAIT)
    assert turn()[3] is proc and not proc.retired                        # unchanged: stays warm
    record_turn(h.hermes_home, "s1", "two", answer="echo two")           # the other process
    used = turn()[3]
    assert used is not proc and proc.retired


def test_a_turn_after_one_aborted_while_loading_waits_for_that_load(pool, tmp_path):
    """An abort while ``session/load`` runs ends the turn and leaves the load running; the
    next turn on that session waits for it instead of loading the session a second time at
    once (two concurrent loads of one session in one Hermes process)."""
    import threading

    from hermes_service.runner import TurnRequest
    from support.hermes_record import record_turn
    runner = pool(max_processes=1)
    runner.env.update(FAKE_ACP_LOAD_DELAY="2")
    h = home(tmp_path, "u1")
    record_turn(h.hermes_home, "s1", "one", answer="echo one")
    from hermes_service.runner.acp.sink import Sink
    cancel = threading.Event()
    req = TurnRequest(message="two", resume_id="s1", home=h, env=runner.env, family="v1",
                      cancel=cancel)
    first = runner._call(runner.turns.run(req, Sink(None), lost=False))
    wait_for(lambda: agent_log(runner, "load"), "the agent to receive session/load")
    cancel.set()
    with pytest.raises(RunError) as err:
        first.result(WAIT)
    assert err.value.code == "run_cancelled"
    again = TurnRequest(message="two", resume_id="s1", home=h, env=runner.env, family="v1")
    runner._call(runner.turns.run(again, Sink(None), lost=False)).result(WAIT)
    assert agent_log(runner, "load") == ["load s1"]


def _stopped_turn(pool, tmp_path, cancel_mode, pieces="echo: |part one |part two ",
                  before_stop=None):
    """A turn that streams ``pieces`` and is aborted once the listener was shown the second
    (the first is no longer held), on an agent that honours or ignores ``session/cancel``;
    ``before_stop(home)`` is called just before the abort.
    Returns (runner, home, the turn's error code, shown text, ACP session id)."""
    import threading

    from hermes_service.runner import TurnRequest
    runner = pool(max_processes=2)
    h = home(tmp_path, "u1")
    runner.env.update(FAKE_ACP_STREAM=pieces, FAKE_ACP_CANCEL=cancel_mode, FAKE_ACP_PIECE_DELAY="0.01",
                      HERMES_HOME=str(h.hermes_home))
    shown, cancel = [], threading.Event()

    class Listener:
        def started(self, handle): pass
        def reasoning(self, text): pass
        def tool(self, *a): pass

        def delta(self, text):
            shown.append(text)
            if len(shown) == 2:
                if before_stop is not None:
                    before_stop(h)
                cancel.set()
    req = TurnRequest(message="tell me", resume_id=None, home=h, env=runner.env, family="mnote",
                      listener=Listener(), cancel=cancel)
    t, outcome = _turn_in_thread(runner, req)
    t.join(WAIT)
    [sid] = [line.split()[1] for line in Path(runner.env["FAKE_ACP_LOG"]).read_text().splitlines()
             if line.startswith("prompt ")]
    return runner, h, outcome.get("code"), "".join(shown), sid


def test_a_stop_keeps_the_shown_text_when_the_process_had_to_be_killed(pool, tmp_path):
    """docs/runners.md "A stopped turn": the agent ignores session/cancel, so the process is
    killed before it saves the partial reply: the service writes the text the listener was
    shown as the interrupted reply Hermes would have saved (user row, then assistant row)."""
    from hermes_service.homes import hermes_state
    from support.hermes_record import active_rows
    runner, h, code, shown, sid = _stopped_turn(pool, tmp_path, "ignore")
    assert code == "run_cancelled" and shown.startswith("echo: part one")
    rows = active_rows(h.hermes_home, sid)
    assert [(r["role"], r["content"]) for r in rows] == [("user", "tell me"), ("assistant", shown.strip())]
    assert hermes_state.session_summary(h.hermes_home, sid)["messageCount"] == 2



def test_a_stop_whose_partial_a_planted_trigger_refuses_still_ends_cancelled(pool, tmp_path):
    """The user's agent planted a trigger on ``messages`` that refuses every insert (RAISE):
    the kill path cannot keep the shown text; the abort still ends the turn with
    run_cancelled (not a raw SQLite error) and nothing is half-written."""
    import sqlite3

    from support.hermes_record import active_rows

    def plant(h):
        with sqlite3.connect(h.hermes_home / "state.db") as db:
            db.execute("CREATE TRIGGER planted BEFORE INSERT ON messages "
                       "BEGIN SELECT RAISE(ABORT, 'planted'); END")
    runner, h, code, shown, sid = _stopped_turn(pool, tmp_path, "ignore", before_stop=plant)
    assert code == "run_cancelled" and shown.startswith("echo: part one")
    assert [r["role"] for r in active_rows(h.hermes_home, sid)] == ["user"]


def test_a_stop_that_hermes_cancelled_keeps_its_partial_once_and_the_process_warm(pool, tmp_path):
    """The agent honours session/cancel and saves the partial reply itself: nothing is
    written twice, and the process stays warm with its record fingerprint current (else the
    next turn there would retire it as stale)."""
    from hermes_service.homes import hermes_state
    from support.hermes_record import active_rows
    runner, h, code, shown, sid = _stopped_turn(pool, tmp_path, "honour")
    assert code == "run_cancelled"
    assert [r["role"] for r in active_rows(h.hermes_home, sid)] == ["user", "assistant"]
    proc = runner.pool.get(("u1", "mnote"))
    assert not proc.retired and not proc.dead
    assert proc.seen[sid] == hermes_state.fingerprint(h.hermes_home, sid)


def test_a_stop_before_any_text_was_shown_keeps_no_reply(pool, tmp_path):
    """Only the first piece arrived (held back: it could be Hermes's error text), so the
    listener was shown nothing: no reply is written (the turn is then taken back as an
    unanswered one, conversations.py), and the process is killed, not cancelled."""
    import threading

    from hermes_service.runner import TurnRequest
    from support.hermes_record import active_rows
    runner = pool(max_processes=2)
    h = home(tmp_path, "u1")
    runner.env.update(FAKE_ACP_STREAM="HTTP 5", HERMES_HOME=str(h.hermes_home))   # error-like
    cancel = threading.Event()
    req = TurnRequest(message="tell me", resume_id=None, home=h, env=runner.env, family="mnote",
                      cancel=cancel)
    t, outcome = _turn_in_thread(runner, req)
    wait_for(lambda: agent_log(runner, "piece"), "the agent to stream its piece")
    cancel.set()
    t.join(WAIT)
    assert outcome.get("code") == "run_cancelled"
    [sid] = [line.split()[1] for line in agent_log(runner, "prompt")]
    assert [r["role"] for r in active_rows(h.hermes_home, sid)] == ["user"]
    assert not agent_log(runner, "cancel")


def _answered_turn(runner, h, message="hi"):
    """One turn of a new conversation on ``h``'s process; returns (its process, the error
    code or "ok")."""
    from hermes_service.runner import TurnRequest
    req = TurnRequest(message=message, resume_id=None, home=h, env=runner.env, family="mnote")
    try:
        runner.run_turn(req)
        code = "ok"
    except RunError as err:
        code = err.code
    return runner.pool.get(("u1", "mnote")), code


def _recording_pool(pool, tmp_path, answer):
    runner = pool(max_processes=2)
    h = home(tmp_path, "u1")
    runner.env.update(HERMES_HOME=str(h.hermes_home), **({"FAKE_ACP_ANSWER": answer} if answer else {}))
    proc = runner._call(runner.pool.acquire(("u1", "mnote"), h, runner.env, [])).result(WAIT)
    return runner, h, proc


def test_a_turn_with_no_answer_retires_its_process(pool, tmp_path):
    """A turn that recorded no answer (upstream_empty_answer) is taken back from the record,
    while the process's memory still holds it: that process takes no further turn."""
    runner, h, proc = _recording_pool(pool, tmp_path, answer=None)
    after, code = _answered_turn(runner, h)
    assert code == "upstream_empty_answer"
    assert proc.retired and after is not proc


def test_an_answered_turn_keeps_its_process_warm(pool, tmp_path):
    runner, h, proc = _recording_pool(pool, tmp_path, answer="the answer")
    after, code = _answered_turn(runner, h)
    assert code == "ok" and after is proc and not proc.retired


def test_a_process_is_recycled_after_recycle_after_sessions(pool, tmp_path):
    """Hermes 0.19.0 never frees an ACP session: after ``recycle_after_sessions`` sessions
    the process is retired at the end of the turn (and a replacement started)."""
    runner, h, proc = _recording_pool(pool, tmp_path, answer="the answer")
    runner.turns.recycle_after = 1                             # the turn's session reaches it
    after, code = _answered_turn(runner, h)
    assert code == "ok" and proc.retired and after is not proc


def test_a_process_is_recycled_above_max_rss_mb(pool, tmp_path):
    runner, h, proc = _recording_pool(pool, tmp_path, answer="the answer")
    assert proc.rss_mb() > 1
    runner.turns.max_rss_mb = 1.0                              # below any live Python process
    after, code = _answered_turn(runner, h)
    assert code == "ok" and proc.retired and after is not proc


@pytest.mark.parametrize("text, held", [
    # what Hermes 0.19.0 sent in place of an answer (measured, scripted model)
    ("HTTP 401: scripted HTTP 401 error", True),
    ("API call failed after 1 retries: HTTP 429: scripted HTTP 429 error", True),
    ("⚠️ No reply: the model returned empty content after retries", True),
    ("Error: boom", True), ("HT", True), ("", True),
    # the first piece of a real streamed answer is shown at once
    ("echo ", False), ("当前页", False), ("Sure, here", False), ("The page", False),
])
def test_only_a_first_piece_that_could_be_error_text_is_held(text, held):
    """docs/runners.md: the first chunk is held back only when it could be the start of the
    error text Hermes sends as an ordinary chunk; any other first piece is shown at once."""
    from hermes_service.runner.acp import could_be_error_text
    assert could_be_error_text(text) is held


def test_a_draining_pool_starts_no_process_and_keeps_its_warm_ones(pool, tmp_path):
    """docs/operations.md §Process lifetime: while the service drains, a turn of a user with a warm
    process gets it; one without runs on the CLI (UseCli); pre-warm does nothing."""
    runner = pool(max_processes=2)
    warm = acquire(runner, tmp_path, "u1").result(WAIT)
    wait_for(lambda: warm.spare is not None and warm.spare.done(), "u1's spare session")
    runner.processes.draining = True
    assert acquire(runner, tmp_path, "u1").result(WAIT) is warm
    with pytest.raises(UseCli, match="draining"):
        acquire(runner, tmp_path, "u2").result(WAIT)
    runner.prewarm(home(tmp_path, "u3"), runner.env, "mnote", [])
    runner._call(runner.pool.retire_key(("u1", "mnote"))).result(WAIT)   # a failed turn: no
    wait_for(lambda: warm.dead, "the retired process to close")      # replacement is started
    assert runner.process_count() == 0 and alive(runner) == []
    assert len(agent_log(runner, "new")) == 1        # u1's spare, made before the drain


def test_a_message_over_the_readers_bound_ends_the_process_and_the_turn(pool, tmp_path):
    """A JSON-RPC line longer than ACP_MESSAGE_BYTES (a forged or runaway message) is never
    buffered whole: the connection ends, the turn fails hermes_failed, the process goes."""
    from hermes_service.runner import TurnRequest
    from hermes_service.runner.acp import ACP_MESSAGE_BYTES
    runner = pool(max_processes=1)
    runner.env["FAKE_ACP_BIG_CHUNK"] = str(ACP_MESSAGE_BYTES + 1024)
    req = TurnRequest(message="hi", resume_id=None, home=home(tmp_path, "u1"), env=runner.env,
                      family="mnote")
    first = acquire(runner, tmp_path, "u1").result(WAIT)        # the process the turn gets
    with pytest.raises(RunError) as failed:
        runner.run_turn(req)
    assert failed.value.code == "hermes_failed"
    wait_for(lambda: first.dead and runner.pool.get(("u1", "mnote")) is not first,
             "the process to be retired and ended", WAIT)


def test_a_replacement_is_built_from_the_settings_in_force(pool, tmp_path):
    """A process replaced after a failed or aborted turn is started from the settings a
    reload put in force (environment, toolsets, approvals) — never copied from the process it
    replaces, which still had the old ones."""
    from hermes_service.installed import build_config
    runner = pool(max_processes=2)
    old = runner._call(runner.pool.acquire(("u1", "mnote"), home(tmp_path, "u1"), runner.env,
                                       ["mnote"])).result(WAIT)
    assert old.env["HERMES_SERVICE_ACP_TOOLSETS"].split(",")[-1] == "mnote"
    assert "RELOADED_SETTING" not in old.env and "terminal" in old.env["HERMES_SERVICE_ACP_TOOLSETS"]
    # a reload: other toolsets, another approval timeout, an extra variable in the environment
    cfg = build_config(deep_merge(base_config(tmp_path), {
        "hermes": {"command": runner.processes.command, "runner": "acp", "toolsets": ["file"],
                   "approvals": {"timeout_seconds": 33},
                   "acp": {"max_processes": 2, "start_timeout_seconds": WAIT}}}))
    runner.processes.configure(cfg.hermes)
    runner.configure(cfg.hermes)                       # retires the warm process
    runner.env = {**runner.env, "RELOADED_SETTING": "1"}
    assert old.retired

    async def aborted():          # what ending its turn early does (Turns._end): replace it
        runner.pool.replace(old)
    runner._call(aborted()).result(WAIT)
    new = wait_for(lambda: (p := runner.pool.get(("u1", "mnote"))) is not None
                   and p is not old and p.ready is not None and p.ready.done() and p,
                   "the replacement process")
    assert new.env["RELOADED_SETTING"] == "1"
    assert new.env["HERMES_SERVICE_ACP_TOOLSETS"].split(",") == ["file", "mnote"]
    assert new.env["HERMES_SERVICE_APPROVAL_TIMEOUT"] == "43.0" and new.extra_toolsets == ["mnote"]


def test_a_replacement_outdated_by_a_reload_while_it_starts_is_made_again(pool, tmp_path):
    runner = pool(max_processes=2)
    runner._call(runner.pool.acquire(("u1", "mnote"), home(tmp_path, "u1"), runner.env, [])
                 ).result(WAIT)
    made = []

    def slow_env(user):
        made.append(user)
        if len(made) == 1:
            runner.pool.outdate()                 # a reload lands while the first env is made
        return home(tmp_path, user), dict(runner.env)
    runner.pool.process_env = slow_env
    runner._call(runner.pool.retire_key(("u1", "mnote"))).result(WAIT)
    wait_for(lambda: len(made) == 2 and runner.pool.get(("u1", "mnote")) is not None,
             "a second, current environment and its process")


# -- a full pool, the turn slots and memory (docs/scaling.md §Sizing a node) -----------------
class _Cli:
    """The CLI runner's seam: records the turns it is handed."""
    name = "cli"

    def __init__(self, processes):
        self.processes = processes
        self.turns: list = []

    def run_turn(self, req):
        from hermes_service.runner import TurnResult
        self.turns.append(req)
        return TurnResult("from the CLI", "cli-session", 0.1)


def test_a_full_pool_runs_the_turn_on_the_cli(pool, tmp_path):
    """Every warm process busy: the turn runs on the CLI runner (docs/runners.md §Fallback to
    the CLI) — never an internal error (the pool's signal once crashed the failure log line:
    ``'UseCli' object has no attribute 'code'``) — and no turn slot stays taken."""
    import threading

    from hermes_service.runner import TurnRequest
    from hermes_service.runner.choice import RunnerChoice
    runner = pool(max_processes=1, new_session_delay=3600)
    cancel = threading.Event()
    busy = TurnRequest(message="hi", resume_id=None, home=home(tmp_path, "u1"), env=runner.env,
                       family="mnote", cancel=cancel)
    t, outcome = _turn_in_thread(runner, busy)
    waiting_in_session_new(runner, "u1")           # u1's turn holds the only process
    cli = _Cli(runner.processes)
    choice = RunnerChoice(cli, runner, frozenset({"mnote"}))
    req = TurnRequest(message="hi", resume_id=None, home=home(tmp_path, "u2"), env=runner.env,
                      family="mnote")
    clock = SimpleNamespace(runner=None)
    held = runner.processes.slots_held    # (u1's spare session/new, which never answers here)
    result = choice.run_turn(req, clock)
    assert (result.answer, clock.runner, cli.turns) == ("from the CLI", "cli", [req])
    assert runner.processes.slots_held == held     # the ACP attempt kept none
    cancel.set()
    t.join(WAIT)
    assert outcome.get("code") == "run_cancelled"


def test_a_start_takes_a_turn_slot_and_a_warm_turn_none(pool, tmp_path):
    """Starting a process is CPU-bound like a CLI turn: it waits for a turn slot, up to
    ``queue_wait_seconds`` for a turn (then 429 ``too_many_runs``); a turn on a warm process
    needs none."""
    from hermes_service.errors import TooManyRuns
    runner = pool(max_processes=2)
    runner.processes.queue_wait = 0.3
    taken = [runner.processes.try_slot() for _ in range(2)]      # every slot (2) taken
    assert taken == [True, True]
    with pytest.raises(TooManyRuns) as err:
        acquire(runner, tmp_path, "u1", reserve=True).result(WAIT)
    assert err.value.headers.get("Retry-After")
    assert runner.process_count() == 0
    runner.processes.release_slot()
    proc = acquire(runner, tmp_path, "u1", reserve=True).result(WAIT)
    # the start gave its slot back; the spare session made ahead takes one while it opens
    wait_for(lambda: proc.spare is not None and proc.spare.done(), "the spare session")
    assert runner.processes.slots_held == 1
    proc.reserved -= 1
    assert runner.processes.try_slot()                           # every slot taken again
    assert acquire(runner, tmp_path, "u1", reserve=True).result(WAIT) is proc   # warm: no slot
    proc.reserved -= 1
    for _ in range(2):
        runner.processes.release_slot()


def test_a_spare_session_waits_while_turns_fill_the_slots(pool, tmp_path):
    """A spare session (made ahead, CPU-bound ``session/new``) waits while as many warm turns
    are in flight as there are turn slots, and a turn needing a session meanwhile opens its
    own instead of waiting for the spare."""
    runner = pool(max_processes=3)
    busy = [acquire(runner, tmp_path, u).result(WAIT) for u in ("u1", "u2")]
    for p in busy:                       # their spares are made while the slots are free
        wait_for(lambda p=p: p.spare is not None and p.spare.done(), "a spare session")
        p.reserved += 1                  # now a turn runs on each
    assert runner.pool.turns_in_flight() == 2 == runner.processes.slot_count
    idle = acquire(runner, tmp_path, "u3").result(WAIT)       # its spare must wait
    assert not idle.spare_opening and idle.spare is not None and not idle.spare.done()
    assert runner._call(idle.new_session()).result(WAIT)      # opened directly, not waited
    for p in busy:
        p.reserved -= 1
    runner.loop.call_soon_threadsafe(idle.make_spare)        # room again: made
    wait_for(lambda: idle.spare is not None and idle.spare.done(), "the spare session")
    wait_for(lambda: runner.processes.slots_held == 0, "every slot given back")


def test_short_memory_closes_idle_processes_and_starts_none(pool, tmp_path, monkeypatch):
    """Available memory below ``hermes.acp.min_available_mb``: the idle process is closed to
    make room, and with none left idle the turn runs on the CLI (UseCli), whatever room
    ``max_processes`` leaves."""
    from hermes_service.runner.acp import pool as pool_module
    runner = pool(max_processes=4)
    idle = acquire(runner, tmp_path, "u1").result(WAIT)
    monkeypatch.setattr(pool_module.machine, "available_mb", lambda: 10)
    with pytest.raises(UseCli, match="memory"):
        acquire(runner, tmp_path, "u2").result(WAIT)
    assert idle.retired and runner.process_count() == 0

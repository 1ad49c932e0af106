"""The ACP runner (docs/runners.md §The ACP runner): one asyncio loop, on its own thread, runs
every connection; worker threads hand it turns with :meth:`AcpRunner.run_turn`, which blocks
like the CLI runner does, and falls back to the CLI (:class:`~..protocol.UseCli`) where this
runner cannot serve a turn."""
from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable

from ...config import HermesSettings
from ...errors import RunError, ServiceError
from ...homes import hermes_state
from ..failures import classify_text, failure_reason
from ..processes import Processes, stopping_error
from ..protocol import (
    LOST_HISTORY_NOTICE,
    TurnRequest,
    TurnResult,
    UseCli,
    answer_from_record,
    context_text,
)
from .pool import Pool
from .process import record_file
from .sink import Sink
from .turn import Turns

log = logging.getLogger("hermes_service.acp")


class AcpRunner:
    """The ACP runner (see the module doc): its :class:`~.pool.Pool` of warm processes and
    the :class:`~.turn.Turns` on them, on its loop. Starts its processes through
    ``processes`` (:class:`~hermes_service.runner.processes.Processes`), which it shares with
    the CLI runner: the command, the slots, the process groups, the run files, the time limits
    and toolsets."""
    name = "acp"

    def __init__(self, hermes: HermesSettings, processes: Processes,
                 process_env: Callable[[str], tuple] | None = None):
        """``process_env(user_id)`` → ``(home, env)``: the user's home brought up to date and
        the environment of a new Hermes process, from the settings in force (the
        composition root gives :class:`~hermes_service.homes.users.UserHomes`'); a
        replacement process (:meth:`.Pool.replace`) is built from it. None: no replacement is
        started ahead; the user's next turn starts one with its own environment."""
        self.processes = processes
        self.pool = Pool(processes, process_env)
        self.turns = Turns(self.pool, processes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self.configure(hermes, retire=False)

    def configure(self, hermes: HermesSettings, retire: bool = True) -> None:
        """Take a (reloaded) ``hermes`` section: ``hermes.acp``, ``hermes.approvals`` and the
        default model (docs/configuring.md §Reload). ``retire``: the section or the users'
        template changed, and warm processes run with the old environment, toolsets, model
        and template: every one is retired (it ends its running turns; the next turn starts a
        new process)."""
        acp, pool = hermes.acp, self.pool
        pool.idle_seconds = float(acp.idle_seconds)
        pool.max_processes = int(acp.max_processes)
        pool.min_available_mb = int(acp.min_available_mb)
        self.turns.recycle_after = int(acp.recycle_after_sessions)
        self.turns.max_rss_mb = float(acp.max_rss_mb)
        pool.start_timeout = float(acp.start_timeout_seconds)
        approvals = hermes.approvals
        pool.approval_timeout = float(approvals.timeout_seconds)
        pool.allow_always = bool(approvals.allow_always)
        pool.ask = approvals.mode == "ask"
        self.default_model = hermes.model.default
        if retire:
            pool.outdate()
        if retire and self._loop is not None:
            self._call(pool.retire_all("the configuration was reloaded")).result(10)

    # -- the loop --------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="acp-loop",
                                 daemon=True).start()
                asyncio.run_coroutine_threadsafe(self.pool.sweep(), self._loop)
            return self._loop

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    # -- public ----------------------------------------------------------------------
    def process_count(self) -> int:
        """ACP processes alive now (accepting or retiring)."""
        return self.pool.process_count()

    def prewarm(self, home, env: dict, family: str, toolsets: list[str]) -> None:
        """Start the user's process for ``family`` in the background (no wait, no error);
        nothing while the service drains (docs/operations.md §Process lifetime).
        ``toolsets``: the family's, offered beside ``hermes.toolsets``."""
        if self.processes.draining or self.processes.stopping:
            return
        if self.process_count() >= self.pool.max_processes and not self.pool.idle():
            return
        fut = self._call(self.pool.acquire((home.user_id, family), home, env, toolsets))

        def failed(f) -> None:
            if not f.cancelled() and f.exception():
                log.info("ACP pre-warm failed: %s", f.exception())
        fut.add_done_callback(failed)

    def run_turn(self, req: TurnRequest) -> TurnResult:
        """Run one turn on the user's ACP process; a process started for it holds a turn slot
        while it starts (:meth:`~.pool.Pool.acquire`). Raises :class:`UseCli` when this
        runner cannot serve it (before anything reached Hermes), TooManyRuns when no slot to
        start its process was free within ``queue_wait_seconds``, else like the CLI runner."""
        source, now = hermes_state.session_state(req.home.hermes_home, req.resume_id)
        if req.model and req.model != self.default_model:
            if source == "acp":       # the CLI turn adds to the record, not to a warm process
                self._call(self.pool.forget(req)).result(5)
            raise UseCli(f"model {req.model} is not hermes.model.default")
        if req.resume_id and source not in (None, "acp"):
            raise UseCli(f"the Hermes session was made by the {source} runner")
        self.processes.check_turn(req.home)
        # no turn slot held: a warm turn waits on the provider, its CPU is small; the start of
        # a process (CPU-bound, like a CLI turn) takes one (docs/scaling.md §Sizing a node)
        started = time.monotonic()
        sink = Sink(req.listener, approvals=req.approvals)
        if source != "acp":
            now = None
        lost = req.resume_id is not None and source is None
        fut = self._call(self.turns.run(req, sink, lost=lost, record=now))
        try:
            sid, response, resumed, proc, waited = fut.result()
            sink.close_tools()
        except UseCli:          # no warm process for it (a full pool, a drain): nothing was
            sink.close_tools()  # sent to Hermes; the caller runs the turn on the CLI
            raise
        except ServiceError as err:
            sink.close_tools()
            self._turn_failed(req, sink, err)
            raise
        except Exception as exc:  # noqa: BLE001 - the protocol failed (process died, ...)
            sink.close_tools()
            if self.processes.stopping:    # the shutdown killed the process and ended the loop
                raise stopping_error() from None
            log.warning("hermes acp turn failed %s: %r", context_text(req.log_ctx), exc)
            self._call(self.pool.retire_key((req.home.user_id, req.family))).result(5)
            raise RunError("the Hermes agent failed", code="hermes_failed") from None
        notice = LOST_HISTORY_NOTICE if req.resume_id and source is None else None
        try:
            answer = answer_from_record(req, sid, limits=self.processes.sandboxed)
            proc.seen[sid] = hermes_state.fingerprint(req.home.hermes_home, sid)
            proc.record_file = record_file(req.home)
        except RunError as failed:
            raise self._unanswered(req, sid, sink, failed) from None
        sink.release()
        sink.complete(answer.text)
        usage = None
        if response is not None and getattr(response, "usage", None) is not None:
            u = response.usage
            usage = {"input_tokens": u.input_tokens or 0, "output_tokens": u.output_tokens or 0,
                     "total_tokens": u.total_tokens or 0}
        return TurnResult(answer.text, sid, time.monotonic() - started, runner=self.name,
                          reasoning=answer.reasoning, resumed=resumed, notice=notice,
                          streamed=sink.delivered > 0, usage=usage, queue_wait=waited,
                          finish_reason=answer.finish_reason)


    def _turn_failed(self, req: TurnRequest, sink: Sink, err: ServiceError) -> None:
        """What a turn that failed with ``err`` leaves: raises 503 ``service_stopping`` when
        the shutdown killed the process it needed; a cancelled turn's shown text is kept in
        the record; an unexpected code is logged."""
        code = err.code
        if self.processes.stopping and code not in ("run_cancelled", "service_stopping"):
            raise stopping_error() from None  # the shutdown killed the process it needed
        if code == "run_cancelled" and sink.shown:
            self._keep_shown(req, getattr(err, "hermes_session_id", None), sink)
        if code not in ("run_cancelled", "service_stopping", "too_many_runs"):
            log.warning("hermes acp turn failed %s code=%s", context_text(req.log_ctx),
                        code)

    def _unanswered(self, req: TurnRequest, sid: str, sink: Sink,
                    failed: RunError) -> ServiceError:
        """The error of a turn whose record holds no answer (``failed``): a provider error
        Hermes streamed as text when that is all there is; the process is retired (its
        in-memory history may hold the turn the record takes back)."""
        error: ServiceError = failed
        record = hermes_state.turn_record(req.home.hermes_home, sid, req.message)
        if record.assistant_rows == 0 and not record.empty_sentinel and sink.text:
            error = classify_text("".join(sink.text))   # a provider error, sent as text
            log.warning("hermes acp turn failed %s code=%s reason=%s",
                        context_text(req.log_ctx), error.code,
                        failure_reason("".join(sink.text)))
        error.hermes_session_id = sid
        # its in-memory history may hold the turn the record takes back: no further turn there
        self._call(self.pool.retire_key((req.home.user_id, req.family))).result(5)
        return error
    def _keep_shown(self, req: TurnRequest, sid: str | None, sink: Sink) -> None:
        """A stopped turn keeps the answer text the client was shown (docs/runners.md §A
        stopped turn): Hermes saved it when ``session/cancel`` ended the prompt, else (the
        process was killed) it is written to the record now."""
        try:
            if hermes_state.keep_partial(req.home.hermes_home, sid, req.message, sink.shown):
                log.info("kept the partial answer of a stopped turn %s",
                         context_text(req.log_ctx))
        except (ServiceError, sqlite3.Error) as exc:   # the abort stands: a
            # tampered home (409), or a state.db another process keeps locked past its timeout
            log.warning("could not keep the partial answer of a stopped turn %s: %s",
                        context_text(req.log_ctx), exc)

    def close(self, timeout: float = 2.0) -> None:
        """Kill every process and stop the loop (the service stops)."""
        for proc in self.pool.every():
            proc.kill("shutdown")
            self.processes.groups.forget(proc)
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout)
        except Exception:     # noqa: BLE001 - best effort at exit
            pass
        loop.call_soon_threadsafe(loop.stop)

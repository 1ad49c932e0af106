"""One turn on a warm process (docs/runners.md §The ACP runner): a process of the pool, its
session opened (``session/new`` or ``session/load``), the prompt sent and watched (abort,
time limit, stall, sandbox limits), and a prompt ended early without leaving a wedged
session. Everything here runs on the runner's loop."""
from __future__ import annotations

import asyncio
import logging
import time

from ...errors import RunError
from ...hermes_site import run_binding
from ...homes import hermes_state
from ...sandbox import kill_strays, zombies
from ..failures import KILLED, limit_error
from ..processes import Processes
from ..protocol import TurnRequest
from .pool import Pool
from .process import AcpProcess, record_file
from .sink import Handle, Sink

log = logging.getLogger("hermes_service.acp")

ABORT_CANCEL_GRACE = 1.0      # seconds an aborted prompt gets to end after session/cancel
POLL_SECONDS = 0.05


def zombie_limit(processes: int) -> int:
    """Zombies at which a warm process is retired after a turn (docs/runners.md §The pool):
    a quarter of ``hermes.sandbox.limits.processes``, at least 8 — well before the limit
    stops Hermes from starting a command."""
    return max(8, processes // 4)


def ended(reason: str) -> RunError:
    """The error of a turn ended early for ``reason`` (a key of ``KILLED``)."""
    status, code, detail = KILLED[reason]
    return RunError(detail, code=code, status=status)


class Turns:
    """The turn steps of the ACP runner, on the processes of its ``pool``. The settings
    (``hermes.acp.recycle_after_sessions``, ``max_rss_mb``) are set by
    :meth:`~.runner.AcpRunner.configure`."""
    recycle_after: int
    max_rss_mb: float

    def __init__(self, pool: Pool, processes: Processes):
        self.pool = pool
        self.processes = processes

    async def run(self, req: TurnRequest, sink: Sink, lost: bool, record: tuple | None = None):
        """Returns (ACP session id, PromptResponse, resumed, process, seconds until the
        process was had). Raises RunError/UseCli/TooManyRuns.
        ``record``: the session's :func:`~hermes_service.homes.hermes_state.fingerprint` now."""
        key = (req.home.user_id, req.family)
        begun = time.monotonic()
        deadline = begun + self.processes.timeout
        while True:
            acquiring = asyncio.ensure_future(self.pool.acquire(
                key, req.home, req.env, req.toolsets, reserve=True))
            reason = await self._wait_open(acquiring, req, deadline)
            if reason is not None:
                # an abort or the time limit while the process starts: the start goes on (the
                # user's next turn finds it warm); the turn ends now, its reservation given back
                acquiring.add_done_callback(self._unreserve)
                raise ended(reason)
            proc = acquiring.result()
            waited = time.monotonic() - begun
            sid = req.resume_id
            if proc.record_file not in (None, record_file(req.home)):
                # its state.db was replaced (the service removed what the agent planted
                # there): the process still writes to the old one, whose turns nobody reads
                self.pool.retire(proc, "its state.db was replaced")
                self._release(proc)
                continue
            if lost or sid not in proc.seen or proc.seen[sid] == record:
                break
            # the record changed since this process's last turn there (another service
            # process on the data dir, a CLI turn): its in-memory history is stale, and
            # Hermes reads a loaded session only once. A fresh process loads it again.
            self.pool.retire(proc, "another process continued one of its sessions")
            self._release(proc)
        try:
            return (*await self._turn_in(proc, req, sink, lost, deadline), proc, waited)
        finally:
            self._release(proc)

    def _release(self, proc: AcpProcess) -> None:
        proc.reserved -= 1
        if not proc.busy and not proc.dead and proc.pgid is not None \
                and proc.launch is not None and proc.launch.sandboxed:
            # nothing a turn started outlives it (a daemonized tool command would burn CPU
            # or hold files between turns, outside every turn's limits)
            strays = kill_strays(proc.pgid)
            if strays:
                log.warning("ended %d process(es) a turn of user=%s left in its sandbox",
                            strays, proc.key[0])
            proc.idle_cpu = proc.launch.cpu_seconds()
            # Hermes (the sandbox's PID 1) never reaps the orphans it inherits: their zombies
            # fill limits.processes over many turns, until the process cannot fork
            dead, sandbox = zombies(proc.pgid), self.processes.sandbox
            if sandbox is not None and dead >= zombie_limit(sandbox.settings.limits.processes):
                self.pool.retire_and_replace(proc, f"{dead} ended processes it does not reap")
        if proc.retired and not proc.busy and not proc.dead:
            asyncio.get_running_loop().create_task(self.pool.close_process(proc, "retired"))

    def _unreserve(self, task) -> None:
        if not task.cancelled() and task.exception() is None:
            self._release(task.result())

    async def _wait_open(self, task, req: TurnRequest, deadline: float) -> str | None:
        """Wait for a step before the prompt (the process, ``session/new``, ``session/load``);
        the reason to give up on it (an abort, the time limit), or None when it is done."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done:
                return None
            if req.cancel is not None and req.cancel.is_set():
                return "cancelled"
            if time.monotonic() >= deadline:
                return "timeout"

    def _opening(self, proc: AcpProcess, sid: str | None) -> asyncio.Future | None:
        """The step that opens the turn's session on ``proc``: a new one (``sid`` None), or a
        ``session/load`` unless the process has it open (None). One load per session: a turn
        aborted while it loads leaves it running, and the next turn there waits for it."""
        if sid is None:
            return asyncio.ensure_future(proc.new_session())
        if sid in proc.sessions:
            return None
        opening = proc.loading.get(sid)
        if opening is None:
            async def load(sid: str = sid) -> str:
                try:
                    return await proc.open_session(sid)
                finally:
                    proc.loading.pop(sid, None)
            opening = proc.loading[sid] = asyncio.ensure_future(load())
        return opening

    async def _turn_in(self, proc: AcpProcess, req: TurnRequest, sink: Sink, lost: bool,
                       deadline: float):
        from acp import text_block
        from acp.schema import ImageContentBlock
        key = proc.key
        sid = None if lost else req.resume_id
        resumed = sid is not None
        opening = self._opening(proc, sid)
        if opening is not None:
            reason = await self._wait_open(opening, req, deadline)
            if reason is not None:
                opening.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved
                if reason != "cancelled":       # Hermes does not answer: end the process
                    await self.pool.kill(proc, reason)
                raise ended(reason)
            sid = opening.result()
        assert sid is not None
        # the run binding rides in the prompt's _meta, into Hermes's memory only
        meta = {run_binding.META: req.plugin_run} if req.plugin_run is not None else {}
        proc.inflight[sid] = sink
        if proc.launch is not None and len(proc.inflight) == 1:
            proc.launch.mark()        # this turn's CPU budget (hermes.sandbox.limits.cpu_seconds)
        if req.listener is not None:
            req.listener.started(Handle(sink))
        # the empty image block keeps Hermes from running the text as a slash command
        blocks = [text_block(req.message),
                  ImageContentBlock(type="image", data="", mime_type="image/png")]
        prompt = proc.connection.prompt(prompt=blocks, session_id=sid, **meta)
        task = asyncio.get_running_loop().create_task(prompt)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved
        try:
            reason = await self._watch(task, proc, sink, req, deadline)
            if reason is not None:
                await self._end(task, proc, sid, sink, reason)
                if reason == "limit":
                    err = limit_error(proc.limit)
                else:
                    status, code, detail = KILLED.get(reason, (
                        502, "hermes_failed", "the user's Hermes process ended; retry"))
                    err = RunError(detail, code=code, status=status)
                err.hermes_session_id = sid
                raise err
            sink.ended = True
            try:
                response = task.result()
            except Exception as exc:  # noqa: BLE001 - any protocol failure: hermes_failed
                self.pool.retire_and_replace(proc, "a prompt failed")
                err = RunError("the Hermes agent failed", code="hermes_failed")
                err.hermes_session_id = sid
                log.warning("ACP prompt failed user=%s: %r", key[0], exc)
                raise err from None
        finally:
            proc.inflight.pop(sid, None)
            proc.last_used = time.monotonic()
        self._recycle_or_keep(proc)
        return sid, response, resumed

    def _recycle_or_keep(self, proc: AcpProcess) -> None:
        """After a prompt: retire (and replace) a process past ``recycle_after_sessions``,
        ``max_rss_mb`` or half its sandbox's CPU limit; else make its next spare session."""
        sandbox = self.processes.sandbox
        cpu_cap = sandbox.settings.limits.cpu_seconds / 2 \
            if sandbox is not None and self.processes.sandboxed else None
        if proc.sessions_opened >= self.recycle_after or proc.rss_mb() > self.max_rss_mb \
                or (cpu_cap is not None and proc.launch is not None
                    and proc.launch.cpu_seconds() > cpu_cap):
            self.pool.retire_and_replace(proc, f"{proc.sessions_opened} sessions, "
                                           f"{proc.rss_mb():.0f} MB, "
                                           f"{proc.cpu_seconds():.0f} s CPU")
        else:
            asyncio.get_running_loop().call_later(0.5, proc.make_spare)

    async def _watch(self, task, proc: AcpProcess, sink: Sink, req: TurnRequest,
                     deadline: float) -> str | None:
        """Wait for the prompt; the reason to end it early, or None when it finished."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done and not (proc.dead and not task.cancelled() and task.exception() is not None):
                return None
            if proc.limit is None and proc.launch is not None:
                proc.limit = proc.launch.limit_hit()
                if proc.limit is not None:
                    proc.kill_reason = "limit"
                    return "limit"
            if proc.dead:
                if proc.limit is not None:
                    return "limit"
                return proc.kill_reason if proc.kill_reason in KILLED else "died"
            if sink.kill_reason or (req.cancel is not None and req.cancel.is_set()):
                return sink.kill_reason if sink.kill_reason in KILLED else "cancelled"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if sink.asking:              # a human is being asked: not a stall
                sink.last_activity = now
            if now - sink.last_activity >= self.processes.stall_timeout:
                return "stall"

    async def _end(self, task, proc: AcpProcess, sid: str, sink: Sink, reason: str) -> None:
        """End a prompt early without leaving a wedged session (docs/runners.md §Known faults
        of Hermes 0.19.0).

        An abort of a prompt that has shown answer text (or that shares the process with
        another turn) and runs no tool gets ``session/cancel`` first: Hermes then saves the
        partial reply itself (measured: ``stopReason: cancelled`` 60-310 ms later). A prompt
        Hermes ended as ``cancelled`` leaves the process warm (its record and memory agree;
        :attr:`AcpProcess.seen` is brought up to date); any other end retires it. A prompt
        that has not ended after :data:`ABORT_CANCEL_GRACE` is killed like every other
        early end (the caller then keeps the shown text: :func:`hermes_state.keep_partial`)."""
        others = [s for s in proc.inflight if s != sid]
        if reason == "cancelled" and (others or sink.delivered) and not sink.tools_running \
                and not proc.dead:
            try:
                await proc.connection.cancel(session_id=sid)
                done, _ = await asyncio.wait({task}, timeout=ABORT_CANCEL_GRACE)
            except Exception as exc:       # noqa: BLE001 - the kill below ends it anyway
                log.info("session/cancel failed user=%s: %r", proc.key[0], exc)
                done = set()
            if done:
                stop = None if task.cancelled() or task.exception() is not None \
                    else getattr(task.result(), "stop_reason", None)
                if stop == "cancelled" and not proc.dead:
                    proc.seen[sid] = await asyncio.get_running_loop().run_in_executor(
                        None, hermes_state.fingerprint, proc.home.hermes_home, sid)
                else:
                    self.pool.retire_and_replace(proc, "a turn was aborted")
                return
        if not proc.dead:
            await self.pool.kill(proc, reason, replace=reason != "shutdown")
        task.cancel()

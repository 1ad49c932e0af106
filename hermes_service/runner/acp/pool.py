"""The warm processes of the ACP runner (docs/runners.md §The ACP runner): one per active user
and route family, started on demand, reused while warm, retired (no new turn; it exits once
its turns end) and replaced from the settings in force, closed when idle or to make room.
Everything here runs on the runner's loop."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ... import machine
from ...errors import RunError
from ...hermes_site import run_binding
from ..failures import failure_reason, limit_error
from ..processes import Processes, stopping_error
from ..protocol import TurnRequest, UseCli
from .client import APPROVAL_MARGIN, APPROVAL_TIMEOUT_ENV, CLARIFY_ENV, CLARIFY_TOOLSET
from .process import AcpProcess

log = logging.getLogger("hermes_service.acp")

#: CPU seconds a warm process's sandbox may use while no turn runs before it is closed
#: (Hermes's own idle work is far below; a process left behind by a turn is not)
IDLE_CPU_SECONDS = 5.0
REPLACE_TRIES = 3             # attempts at a replacement process that reloads keep outdating
SLOT_POLL_SECONDS = 0.05      # how often a start waiting for a turn slot looks again
SPARE_POLL_SECONDS = 0.5     # how often a spare session waiting for room looks again
SWEEP_SECONDS = 5.0           # the longest between two looks at idle processes and memory


class Pool:
    """The processes, by ``(user id, route family)``. The settings (``hermes.acp``,
    ``hermes.approvals``) are set by :meth:`~.runner.AcpRunner.configure`; the turns on them
    are :class:`~.turn.Turns`'."""
    idle_seconds: float
    max_processes: int
    min_available_mb: int
    start_timeout: float
    approval_timeout: float
    allow_always: bool
    ask: bool

    def __init__(self, processes: Processes,
                 process_env: Callable[[str], tuple] | None = None):
        self.processes = processes
        self.process_env = process_env
        self._procs: dict[tuple[str, str], AcpProcess] = {}     # accepting new turns
        self._retired: set[AcpProcess] = set()
        self._generation = 0      # counts the reloads that retired every process
        self._turns_waiting = 0   # turns waiting for a slot to start their process

    @property
    def own_tool_prefixes(self) -> tuple[str, ...]:
        """Tool-name prefixes of the calls the route families report themselves."""
        return tuple(f.own_tool_prefix for f in self.processes.families.values()
                     if f.own_tool_prefix)

    def get(self, key) -> AcpProcess | None:
        """The process taking ``key``'s turns now, if any."""
        return self._procs.get(key)

    def every(self) -> list[AcpProcess]:
        """Every process alive now (accepting or retiring)."""
        return list(self._procs.values()) + list(self._retired)

    def outdate(self) -> None:
        """A reload changed what a process is started with: a replacement being made from
        the old settings is retired once started (:meth:`_replacement`)."""
        self._generation += 1

    async def retire_all(self, why: str) -> None:
        """Retire every accepting process (:meth:`retire`)."""
        for proc in list(self._procs.values()):
            self.retire(proc, why)

    def process_count(self) -> int:
        """ACP processes alive now (accepting or retiring)."""
        return len(self._procs) + len(self._retired)

    def idle(self) -> list[AcpProcess]:
        procs = list(self._procs.values()) + list(self._retired)
        return sorted((p for p in procs if not p.busy and not p.dead
                       and p.ready is not None and p.ready.done()),   # not while it starts
                      key=lambda p: p.last_used)

    async def acquire(self, key, home, env: dict, toolsets: list[str],
                       reserve: bool = False) -> AcpProcess:
        """The user's process for ``key``, started if needed (``toolsets``: the family's,
        beside ``hermes.toolsets``). ``reserve``: for a turn, which must release it
        (``proc.reserved -= 1``); a reserved process is never idle.

        A start holds a turn slot (it is CPU-bound like a CLI turn): a turn waits for one up
        to ``queue_wait_seconds`` (then TooManyRuns), a pre-warm or a replacement as long as
        it takes, after the turns waiting. Raises UseCli when the pool is full of busy
        processes, or memory is below ``hermes.acp.min_available_mb`` with none idle to close
        (docs/runners.md §Fallback to the CLI), or the service drains."""
        slot = False
        deadline = time.monotonic() + self.processes.queue_wait
        try:
            while True:       # every await below may change the pool: look again after it
                proc = self._procs.get(key)
                if proc is not None and not proc.dead and proc.ready is not None:
                    ok = await asyncio.shield(proc.ready)
                    if ok and not proc.dead and not proc.retired:
                        proc.last_used = time.monotonic()
                        proc.reserved += reserve
                        return proc
                    continue
                if self.processes.draining:     # the service is stopping: no new process (
                    raise UseCli("the service is draining")  # docs/operations.md §Process lifetime)
                if self.process_count() >= self.max_processes:
                    idle = self.idle()
                    if not idle:
                        raise UseCli("the ACP process pool is full")
                    await self.close_process(idle[0], "evicted")
                    continue
                if self.memory_short():
                    idle = self.idle()
                    if not idle:
                        raise UseCli("memory is below hermes.acp.min_available_mb")
                    await self.close_process(idle[0], "memory is short")
                    continue
                if not slot:
                    slot = await self._start_slot(deadline if reserve else None)
                    continue      # the wait may have changed the pool
                proc = await self._start(key, home, env, toolsets)
                self.processes.release_slot()
                slot = False
                if proc.retired:      # retired while it started (a reload): start a fresh one
                    asyncio.get_running_loop().create_task(self.close_process(proc, "retired"))
                    continue
                proc.reserved += reserve
                return proc
        finally:
            if slot:
                self.processes.release_slot()

    async def _start_slot(self, deadline: float | None) -> bool:
        """Wait for a turn slot to start a process: until ``deadline`` (a turn: then
        TooManyRuns), or without end after every turn waiting for one (None: a pre-warm or a
        replacement). Raises UseCli when the service drains or stops meanwhile."""
        turn = deadline is not None
        self._turns_waiting += turn
        try:
            while True:
                if self.processes.stopping:
                    raise stopping_error()
                if self.processes.draining:
                    raise UseCli("the service is draining")
                if (turn or not self._turns_waiting) and self.processes.try_slot():
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    raise self.processes.too_many_runs()
                await asyncio.sleep(SLOT_POLL_SECONDS)
        finally:
            self._turns_waiting -= turn

    async def spare_slot(self) -> None:
        """Wait for room for work made ahead (a spare session: :meth:`AcpProcess.make_spare`)
        — fewer warm turns in flight than turn slots, no turn waiting for a slot, a slot
        free — and take that slot (give it back with ``processes.release_slot()``). Raises
        UseCli when the service drains or stops meanwhile."""
        while True:
            if self.processes.draining or self.processes.stopping:
                raise UseCli("the service is draining")
            if not self._turns_waiting and self.turns_in_flight() < self.processes.slot_count \
                    and self.processes.try_slot():
                return
            await asyncio.sleep(SPARE_POLL_SECONDS)

    def turns_in_flight(self) -> int:
        """Turns running (or about to) on warm processes."""
        return sum(p.busy for p in (*self._procs.values(), *self._retired))

    def memory_short(self) -> bool:
        """Is the memory available now (:func:`hermes_service.machine.available_mb`) below
        ``hermes.acp.min_available_mb``?"""
        available = machine.available_mb()
        return available is not None and available < self.min_available_mb

    async def _start(self, key, home, env: dict, extra: list[str]) -> AcpProcess:
        toolsets = self.processes.toolset_names(extra)      # hermes.toolsets in force now
        env = {**env, "HERMES_SERVICE_ACP_TOOLSETS": ",".join(toolsets),
               APPROVAL_TIMEOUT_ENV: str(self.approval_timeout + APPROVAL_MARGIN)}
        env.pop("HERMES_SERVICE_TURN_FILE", None)
        env.pop(run_binding.ENV, None)       # a CLI turn's run binding is not for it
        family = self.processes.families.get(key[1])
        if family is not None and family.asks_user:
            if self.ask:           # its turns can ask the panel's user: offer clarify
                toolsets = [*(t for t in toolsets if t != CLARIFY_TOOLSET), CLARIFY_TOOLSET]
                env["HERMES_SERVICE_ACP_TOOLSETS"] = ",".join(toolsets)
                env[CLARIFY_ENV] = "1"
        proc = AcpProcess(self, key, home, env, extra)
        ready = proc.ready = asyncio.get_running_loop().create_future()
        self._procs[key] = proc
        try:
            await proc.start()
            if ready.done() or proc.dead:      # closed while it started
                raise RuntimeError("the process was closed while it started")
        except Exception as exc:  # noqa: BLE001 - any failure to start: the waiters get it
            if self._procs.get(key) is proc:
                del self._procs[key]
            if not ready.done():
                ready.set_exception(exc)
                ready.exception()      # retrieved: no "never retrieved" warning
            proc.kill("start failed")
            log.warning("ACP process for user=%s could not start: %s %s", key[0], exc,
                        failure_reason(proc.stderr_tail.decode("utf-8", "replace")[-2000:]))
            hit = proc.launch.limit_hit() if proc.launch is not None else None
            if hit is not None:      # ended by a limit while it started (the disk watcher's
                raise limit_error(hit) from None     # home_quota: 507), never a 502
            raise RunError("the Hermes ACP process could not be started (see the service log)",
                           code="hermes_failed") from None
        ready.set_result(True)
        if not proc.retired:
            proc.make_spare()
        return proc

    def gone(self, proc: AcpProcess) -> None:
        """``proc`` takes no further turn (it exited, or is being killed)."""
        if self._procs.get(proc.key) is proc:
            del self._procs[proc.key]
        self._retired.discard(proc)
        if proc.ready is not None and not proc.ready.done():
            proc.ready.set_result(False)

    async def close_process(self, proc: AcpProcess, why: str) -> None:
        log.info("closing ACP process of user=%s (%s)", proc.key[0], why)
        await self.kill(proc, why, replace=False)

    async def kill(self, proc: AcpProcess, reason: str, replace: bool = True) -> None:
        """End ``proc`` now (it takes no further turn); ``replace``: start its replacement
        (:meth:`replace`)."""
        proc.retired = True
        self.gone(proc)
        await proc.kill_async(reason)
        if replace:
            self.replace(proc)

    def retire(self, proc: AcpProcess, why: str) -> None:
        """No new turn for ``proc``; it exits once its running turns end."""
        if proc.dead or proc.retired:
            return
        log.info("retiring ACP process of user=%s (%s)", proc.key[0], why)
        proc.retired = True
        if self._procs.get(proc.key) is proc:
            del self._procs[proc.key]
        self._retired.add(proc)
        if not proc.busy and (proc.ready is None or proc.ready.done()):
            asyncio.get_running_loop().create_task(self.close_process(proc, why))

    def retire_and_replace(self, proc: AcpProcess, why: str) -> None:
        """Retire ``proc`` (:meth:`retire`) and start its replacement (:meth:`replace`):
        the user is active, and the next turn should find a warm process."""
        self.retire(proc, why)
        self.replace(proc)

    async def retire_key(self, key) -> None:
        proc = self._procs.get(key)
        if proc is not None:
            self.retire_and_replace(proc, "a turn failed")

    async def forget(self, req: TurnRequest) -> None:
        """A turn of an ACP session runs on the CLI (another model): the user's warm process
        keeps that conversation in memory and would answer its next turn without the CLI's
        turn (Hermes reads a loaded session's history from state.db only once), so it takes
        no further turn; a replacement loads the session afresh."""
        proc = self._procs.get((req.home.user_id, req.family))
        if proc is not None and req.resume_id in proc.sessions:
            self.retire_and_replace(proc, "a CLI turn continues one of its sessions")

    def replace(self, old: AcpProcess) -> None:
        """Start a replacement for a retired process in the background (the user is active):
        built from the settings in force (:attr:`process_env`, its family's toolsets), never
        copied from ``old``; none while the service drains or without ``process_env``."""
        if self.processes.draining or self.process_env is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._replacement(old.key, list(old.extra_toolsets)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _replacement(self, key, extra: list[str]) -> None:
        """Start ``key``'s process from a fresh :attr:`process_env`; again when a reload
        retired every process while it was made (at most :data:`REPLACE_TRIES` times)."""
        loop = asyncio.get_running_loop()
        process_env = self.process_env
        if process_env is None:
            return
        for _ in range(REPLACE_TRIES):
            generation = self._generation
            home, env = await loop.run_in_executor(None, process_env, key[0])
            if generation != self._generation or self.processes.draining:
                continue
            proc = await self.acquire(key, home, env, extra)
            if generation == self._generation:
                return
            self.retire(proc, "the configuration was reloaded while it started")

    async def sweep(self) -> None:
        """Run on the loop for its life: close idle processes (past ``idle_seconds``, or
        while memory is short, least recently used first), retired ones once free, and those
        that used CPU between turns."""
        while True:
            await asyncio.sleep(min(SWEEP_SECONDS, max(1.0, self.idle_seconds / 4)))
            # memory pressure: the least recently used idle processes go first, while the
            # memory available is below the floor
            while self.memory_short():
                idle = self.idle()
                if not idle:
                    break
                await self.close_process(idle[0], "memory is short")
            now = time.monotonic()
            for proc in list(self._procs.values()) + list(self._retired):
                if proc.dead or proc.busy or proc.ready is None or not proc.ready.done():
                    continue          # in use, or still starting
                if proc.retired:
                    await self.close_process(proc, "retired")
                elif now - proc.last_used >= self.idle_seconds:
                    await self.close_process(proc, "idle")
                elif proc.idle_cpu is not None and proc.launch is not None and \
                        proc.launch.cpu_seconds() - proc.idle_cpu > IDLE_CPU_SECONDS:
                    await self.close_process(proc, "it used CPU between turns")

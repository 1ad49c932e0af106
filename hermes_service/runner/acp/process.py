"""One ``hermes acp`` process (docs/runners.md §The ACP runner): its launch in the user's
sandbox and process group, its connection, the sessions it has opened, its running prompts,
and its end."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from ...instance import proc_start
from ...sandbox import Launch, limit_signal, tree_cpu_seconds, tree_rss_mb
from ..failures import failure_reason
from ..processes import Processes, kill_group
from .client import Asking, Client
from .sink import Sink

if TYPE_CHECKING:
    from acp import ClientSideConnection

log = logging.getLogger("hermes_service.acp")

STDERR_TAIL_BYTES = 16384
#: The largest JSON-RPC message read from a Hermes process (bytes, one line). A longer one
#: ends the connection: the process is retired and its turn fails ``hermes_failed``
#: (docs/mnote-client.md §Sizes of events). Hermes's own largest messages — a replayed tool
#: result of a session/load — stay far below it.
ACP_MESSAGE_BYTES = 8 * 1024 * 1024


class Owner(Asking, Protocol):
    """What a process needs of its pool (:class:`~.pool.Pool`)."""
    processes: Processes
    start_timeout: float

    def gone(self, proc: AcpProcess) -> None: ...

    async def spare_slot(self) -> None: ...


class AcpProcess:
    """One ``hermes acp`` process: its connection, the sessions it has loaded, its running
    prompts. Lives on the runner's loop; :meth:`kill` may be called from any thread."""

    def __init__(self, runner: Owner, key: tuple[str, str], home, env: dict,
                 extra_toolsets: list[str] | None = None):
        self.runner, self.key, self.home, self.env = runner, key, home, env
        #: the toolsets it was started with beyond ``hermes.toolsets`` (its family's)
        self.extra_toolsets = list(extra_toolsets or [])
        self.proc: asyncio.subprocess.Process | None = None
        self.pgid: int | None = None
        self.conn: ClientSideConnection | None = None
        self.ready: asyncio.Future | None = None
        self.sessions: set[str] = set()
        self.loading: dict[str, asyncio.Future] = {}  # session/load in flight, by session
        self.seen: dict[str, tuple | None] = {}   # session -> its record after our last turn
        self.record_file: tuple | None = None   # its state.db (device, inode) after that turn
        self.inflight: dict[str, Sink] = {}
        self.reserved = 0        # turns that acquired this process and have not ended yet
        self.sessions_opened = 0
        self.spare_opening = False     # the spare's session/new was sent (not still waiting)
        # a session/new made ahead for the next conversation
        self.spare: asyncio.Task | None = None
        self.last_used = time.monotonic()
        self.retired = False
        self.dead = False
        self.kill_reason: str | None = None
        self.stderr_tail = bytearray()
        self.launch: Launch | None = None
        self.limit: str | None = None     # the sandbox limit that ended it (sandbox/)
        self.idle_cpu: float | None = None  # its sandbox's CPU seconds when its last turn ended
        sandbox = runner.processes.sandbox
        self.cwd = sandbox.home_path(home) if sandbox else str(home.root)

    # -- life ------------------------------------------------------------------------
    async def start(self) -> None:
        import acp
        from acp.schema import ClientCapabilities, Implementation
        launch = self.launch = self.runner.processes.launch(["acp"], self.env, self.home)
        try:
            proc = self.proc = await asyncio.create_subprocess_exec(
                *launch.argv, env=launch.env, cwd=launch.cwd,
                pass_fds=launch.pass_fds, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, limit=ACP_MESSAGE_BYTES)
        except OSError:
            launch.close()
            raise
        launch.pid = proc.pid
        launch.started()
        self.pgid = proc.pid
        self.runner.processes.groups.add(self, self.env.get("HERMES_HOME"))
        loop = asyncio.get_running_loop()
        # the loop keeps only weak references to tasks: hold ours until the process ends
        self._readers = (loop.create_task(self._drain_stderr()),
                         loop.create_task(self._watch_exit()))
        # (Client is no acp.interfaces.Client: it offers no terminal, so it has no such method)
        conn = self.conn = acp.connect_to_agent(Client(self),  # type: ignore[arg-type]
                                                proc.stdin, proc.stdout)
        await asyncio.wait_for(conn.initialize(
            protocol_version=acp.PROTOCOL_VERSION, client_capabilities=ClientCapabilities(),
            client_info=Implementation(name="hermes-service", version="1")),
            self.runner.start_timeout)
        log.info("ACP process started user=%s family=%s pid=%s", self.key[0], self.key[1],
                 self.pgid)

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None     # started
        while True:
            chunk = await self.proc.stderr.read(65536)
            if not chunk:
                return
            self.stderr_tail += chunk
            del self.stderr_tail[:-STDERR_TAIL_BYTES]

    async def _watch_exit(self) -> None:
        assert self.proc is not None and self.launch is not None         # started
        rc = await self.proc.wait()
        self.limit = self.limit or self.launch.limit_hit() or limit_signal(rc)
        self.launch.close()
        self.dead = True
        self.runner.processes.groups.forget(self)
        self.runner.gone(self)
        if self.conn is not None:       # its pending requests fail (ConnectionError) instead of
            try:                        # waiting for ever; its tasks end instead of being dropped
                await self.conn.close()
            except Exception:           # noqa: BLE001 - the process is gone either way
                pass
        if self.kill_reason is None and not self.retired:
            log.warning("ACP process of user=%s exited rc=%s: %s", self.key[0], rc,
                        failure_reason(self.stderr_tail.decode("utf-8", "replace")[-2000:]))

    def kill(self, reason: str) -> None:
        """Kill the process group (SIGTERM, SIGKILL after 1 s). Any thread; idempotent."""
        if self.pgid is None:
            return
        self.kill_reason = self.kill_reason or reason
        pid = self.pgid

        def wait(timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if proc_start(pid) is None:
                    return True
                time.sleep(0.02)
            return proc_start(pid) is None
        kill_group(pid, wait, tree=self.launch is not None and self.launch.sandboxed)

    # -- sessions ----------------------------------------------------------------------
    @property
    def connection(self) -> ClientSideConnection:
        """The process's connection; ConnectionError before :meth:`start` made it."""
        if self.conn is None:
            raise ConnectionError("the ACP process has not started")
        return self.conn

    async def open_session(self, session_id: str | None = None) -> str:
        """Open a session on this process: ``session/new`` for a new conversation, else
        ``session/load`` of ``session_id`` (Hermes restores it on the config's model and
        endpoint, never the ones its state.db row names: hermes_site/sitecustomize.py).
        Every opened session counts towards ``hermes.acp.recycle_after_sessions``."""
        if session_id is None:
            session_id = (await self.connection.new_session(cwd=self.cwd)).session_id
        else:
            await self.connection.load_session(cwd=self.cwd, session_id=session_id)
        self.sessions.add(session_id)
        self.sessions_opened += 1
        return session_id

    async def new_session(self) -> str:
        """An ACP session for a new conversation: the spare one made ahead when there is one
        (``session/new`` takes 1.5–3 s in Hermes 0.19.0), else a new one — also when the
        spare still waits for room to be made (:meth:`make_spare`)."""
        spare, self.spare = self.spare, None
        if spare is not None and not self.spare_opening:
            spare.cancel()
        elif spare is not None:
            try:
                return await spare
            except Exception:  # noqa: BLE001 - the spare failed: make one now
                pass
        return await self.open_session()

    def make_spare(self) -> None:
        """Make the next conversation's session ahead, while the process is idle. It is
        work done ahead, CPU-bound: it waits for room (:meth:`Owner.spare_slot`: fewer warm
        turns in flight than turn slots, no turn waiting for one) and holds a turn slot, so a
        burst of turns is never slowed by the spares of those that ended first."""
        if self.spare is None and not self.inflight and not self.retired and not self.dead \
                and not self.runner.processes.draining:
            self.spare_opening = False
            self.spare = asyncio.get_running_loop().create_task(self._make_spare())
            self.spare.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _make_spare(self) -> str:
        """The spare's ``session/new``, holding a turn slot for at most ``start_timeout``
        seconds (a session/new that never answers keeps no slot)."""
        await self.runner.spare_slot()
        try:
            if self.inflight or self.retired or self.dead:
                raise RuntimeError("no longer idle")
            self.spare_opening = True
            opening = asyncio.ensure_future(self.open_session())
            await asyncio.wait({opening}, timeout=self.runner.start_timeout)
        finally:
            self.runner.processes.release_slot()
        return await opening

    # -- state -------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Is a turn using (or about to use) this process?"""
        return bool(self.inflight) or self.reserved > 0

    async def kill_async(self, reason: str) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.kill, reason)

    def rss_mb(self) -> float:
        """Resident memory of the process and everything it started (its sandbox), MiB."""
        return tree_rss_mb(self.pgid) if self.pgid is not None else 0.0

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pgid) if self.pgid is not None else 0.0


def record_file(home) -> tuple | None:
    """``(device, inode)`` of the home's ``state.db`` (not followed), None when missing."""
    try:
        st = os.lstat(home.hermes_home / "state.db")
    except OSError:
        return None
    return st.st_dev, st.st_ino

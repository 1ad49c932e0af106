"""Hermes processes: how they start, are limited and are killed. :class:`Processes` is the
one owner of the turn slots, the process groups and the launcher; both runners, ``execute``,
``/status`` and ``gc`` start Hermes through it.

**Sandbox.** Every Hermes process — CLI turns, ACP processes, ``execute``, ``--version``,
``gc``'s deletions — is started through :meth:`Processes.launch`, i.e. the launcher of
:mod:`hermes_service.sandbox` (one rule): in a bubblewrap sandbox of its own, or unconfined
under ``hermes.sandbox.mode: none``. A sandbox's limits end a turn with
``run_limit_exceeded`` (422); a home over ``hermes.sandbox.max_home_mb`` is refused with
``home_quota_exceeded`` (507) before Hermes starts, a disk below its floor with
``storage_full`` (507), a user whose ``hermes.limits.daily_tokens`` are spent with
``token_budget_exceeded`` (429); every sandbox is watched while it lives
(:mod:`hermes_service.disk.quota`).

**Limits.** At most ``hermes.max_concurrent_runs`` CLI turns, and starts of warm ACP
processes, run at once (per service process: the cores by default; a warm ACP turn holds no
slot, docs/scaling.md §Sizing a node); a caller waits up to ``hermes.queue_wait_seconds`` for
a slot, then gets :class:`~hermes_service.errors.TooManyRuns` (429). Every Hermes process
group is recorded in ``<data>/pids/`` while it runs (:class:`ProcessGroups`), so shutdown
kills them all and the next start reaps what a crashed service left.

Just over 500 lines, as one concern: :class:`Processes` is the one owner of what a Hermes
process holds (slot, group, sandbox, watch) from its start to its end; :class:`ProcessGroups`
and :class:`CliProcess` are the records it keeps of them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import HermesSettings
from ..disk.quota import Disk
from ..errors import RunError, ServiceError, StorageFull, TooManyRuns, Unconfigured
from ..files import atomic_write
from ..instance import alive_pid, proc_start
from ..limits import Limiter
from ..model_proxy.policy import Refusal
from ..model_proxy.usage import budget_error
from ..sandbox import Launch, Sandbox, limit_signal, signal_tree
from .run_files import RunFiles

if TYPE_CHECKING:
    from ..homes.users import UserHome

log = logging.getLogger("hermes_service.runner")

KILL_GRACE_SECONDS = 1.0
#: how Hermes reports a model request the pass-through refused for a spent budget
_MAYBE_BUDGET = frozenset({"upstream_empty_answer", "upstream_rate_limited",
                           "upstream_unavailable", "hermes_failed"})
#: What the service keeps of a Hermes process's output (bytes): the first STDOUT_BYTES of its
#: standard output (Hermes's own error text; the answer is read from its record) and the last
#: STDERR_BYTES of its standard error (its last line names the session). The rest is read
#: and dropped, so a process writing without end costs the service no memory.
STDOUT_BYTES = 1024 * 1024
STDERR_BYTES = 64 * 1024


@dataclass
class Outcome:
    """What a finished :class:`CliProcess` left: exit code, output, and why it was killed (if)."""
    returncode: int
    stdout: str
    stderr: str
    duration: float
    killed: str | None = None        # "timeout" | "stall" | "cancelled" | "limit" | None
    truncated: bool = False
    limit: str | None = None         # with killed="limit": memory | processes | cpu | file_size


class CliProcess:
    """One CLI process in its own process group, with output readers and kill support.

    ``touch()`` records activity from outside (e.g. a tool call) for the
    stall watchdog. ``kill(reason)`` terminates the whole process group
    (SIGTERM, then SIGKILL after ``KILL_GRACE_SECONDS``) and is idempotent.
    """

    def __init__(self, launch: Launch, max_output_bytes: int | None = None, on_exit=None):
        self.launch = launch
        self.argv = launch.argv
        self._on_exit = on_exit
        self.started = time.monotonic()
        self.last_activity = self.started
        self.killed: str | None = None
        self.limit: str | None = None     # which sandbox limit ended it (see sandbox/)
        self._max = STDOUT_BYTES if max_output_bytes is None else max_output_bytes
        self._tail = STDERR_BYTES if max_output_bytes is None else max_output_bytes
        self._out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._truncated = False
        self._kill_lock = threading.Lock()
        try:
            self.proc = subprocess.Popen(launch.argv, env=launch.env, cwd=launch.cwd,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True,
                                         pass_fds=launch.pass_fds)
        except OSError:
            launch.close()
            raise
        launch.pid = self.proc.pid
        launch.started()
        self.pgid = self.proc.pid   # start_new_session: the child leads its own group
        self._readers = [threading.Thread(target=self._read, args=(name, getattr(self.proc, name)),
                                          daemon=True) for name in self._out]
        for t in self._readers:
            t.start()

    def _read(self, name: str, stream) -> None:
        """Read one stream to its end: stdout's head (up to ``_max``), stderr's tail (up to
        ``_tail``)."""
        buf = self._out[name]
        for chunk in iter(lambda: stream.read1(65536), b""):
            self.last_activity = time.monotonic()
            if name == "stderr":
                buf.extend(chunk)
                if len(buf) > self._tail:
                    del buf[:-self._tail]
                    self._truncated = True
                continue
            room = max(0, self._max - len(buf))
            if room < len(chunk):
                self._truncated = True
            buf.extend(chunk[:room])
        stream.close()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def kill(self, reason: str) -> None:
        """Kill the process group; records ``reason`` unless the process already ended."""
        with self._kill_lock:
            if self.proc.poll() is not None and self.killed is None:
                return
            if self.killed is None:
                self.killed = reason
        def wait(timeout: float) -> bool:
            try:
                self.proc.wait(timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        kill_group(self.pgid, wait, tree=self.launch.sandboxed)

    def wait(self, timeout: float | None, stall_timeout: float | None = None,
             cancel: threading.Event | None = None) -> Outcome:
        """Wait for the end, killing the group on timeout, stall or ``cancel``."""
        deadline = self.started + timeout if timeout else None
        while True:
            try:
                self.proc.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            hit = self.launch.limit_hit()
            if hit and self.limit is None:
                self.limit = hit
                self.kill("limit")
            elif cancel is not None and cancel.is_set():
                self.kill("cancelled")
            elif deadline and now >= deadline:
                self.kill("timeout")
            elif stall_timeout and now - self.last_activity >= stall_timeout:
                self.kill("stall")
        for t in self._readers:
            t.join(5)
        if self.limit is None:
            self.limit = self.launch.limit_hit() or limit_signal(self.proc.returncode)
            if self.limit and self.killed is None:
                self.killed = "limit"
        self.launch.close()
        if self._on_exit:
            self._on_exit(self)
        text = {k: v.decode("utf-8", "replace") for k, v in self._out.items()}
        return Outcome(self.proc.returncode, text["stdout"], text["stderr"],
                       time.monotonic() - self.started, self.killed, self._truncated,
                       self.limit)


def stopping_error() -> RunError:
    return RunError("the service is shutting down; retry", code="service_stopping", status=503,
                    headers={"Retry-After": "5"})


class ProcessGroups:
    """Every Hermes process group this service runs (CLI turns, ACP processes), recorded in
    ``<pid_dir>/<pgid>.json`` while alive so :meth:`kill_all` at shutdown and
    :meth:`reap_orphans` after a crash can end them. Members have ``pgid`` and ``kill(reason)``."""

    def __init__(self, pid_dir: Path | None):
        self.pid_dir = pid_dir
        self._live: set = set()
        self._homes: dict = {}          # member -> its HERMES_HOME (kill_home)
        self._lock = threading.Lock()
        if pid_dir is not None:
            pid_dir.mkdir(parents=True, exist_ok=True)

    def add(self, member, home: str | None) -> None:
        with self._lock:
            self._live.add(member)
            self._homes[member] = home
        if self.pid_dir is not None:
            try:            # whole or not at all: a full disk leaves no empty record
                atomic_write(self.pid_dir / f"{member.pgid}.json", json.dumps({
                    "service_pid": os.getpid(), "service_start": proc_start(os.getpid()),
                    "leader_start": proc_start(member.pgid), "home": home}), durable=False)
            except OSError as exc:   # the group is still killed at shutdown (in memory)
                log.warning("no pid record for process group %d (%s): if this process "
                            "crashes, the next start cannot reap it", member.pgid, exc)

    def forget(self, member) -> None:
        with self._lock:
            self._live.discard(member)
            self._homes.pop(member, None)
        if self.pid_dir is not None:
            (self.pid_dir / f"{member.pgid}.json").unlink(missing_ok=True)

    def count(self, kind: type | None = None) -> int:
        with self._lock:
            return sum(1 for m in self._live if kind is None or isinstance(m, kind))

    def kill_all(self, reason: str = "shutdown") -> int:
        """Kill every live process group at once (in parallel). Returns how many."""
        with self._lock:
            live = list(self._live)
        return _kill_each(live, reason)

    def kill_home(self, hermes_home: str, reason: str) -> int:
        """Kill the live groups running with ``hermes_home`` (one user's: CLI turns and warm
        ACP processes), in parallel; returns how many (a node that lost the user's lease)."""
        with self._lock:
            live = [m for m in self._live if self._homes.get(m) == hermes_home]
        return _kill_each(live, reason)

    def reap_orphans(self) -> int:
        """Kill process groups left by a service process that died (kill -9, crash).

        A record is acted on only if its service process is gone and the group leader is
        still the process it recorded (same pid and start time; records of older versions:
        its HERMES_HOME matches), so a reused pid is safe. A sandbox's processes die with
        its bwrap leader (PID namespace). Returns how many groups were killed.
        """
        if self.pid_dir is None:
            return 0
        reaped = 0
        for record in self.pid_dir.glob("*.json"):
            try:
                info = json.loads(record.read_text())
                pgid = int(record.stem)
            except (OSError, ValueError):
                record.unlink(missing_ok=True)
                continue
            if alive_pid(info.get("service_pid"), info.get("service_start")):
                continue
            home = (info.get("home") or "").encode()
            if info.get("leader_start") is not None:
                ours = proc_start(pgid) == info["leader_start"]
            else:
                try:
                    environ = Path(f"/proc/{pgid}/environ").read_bytes()
                except OSError:
                    environ = b""
                ours = bool(home) and b"HERMES_HOME=" + home + b"\0" in environ
            if ours:
                signal_tree(pgid, signal.SIGKILL)
                try:
                    os.killpg(pgid, signal.SIGKILL)
                    reaped += 1
                except ProcessLookupError:
                    pass
            record.unlink(missing_ok=True)
        return reaped


def _kill_each(members: list, reason: str) -> int:
    """``member.kill(reason)`` for each, in parallel (10 s each at most); how many."""
    threads = [threading.Thread(target=m.kill, args=(reason,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return len(members)


def kill_group(pgid: int, wait, grace: float = KILL_GRACE_SECONDS, tree: bool = False) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds (or at once once the
    leader is gone, so no child survives). ``wait(timeout)`` waits for the leader and
    returns True when it ended.

    ``tree``: the group leads a sandbox (bwrap), whose processes are in sessions of their
    own: SIGTERM goes to every process inside it (Hermes saves its session, as on Ctrl-C)
    and the SIGKILL to the bwrap group, which ends the sandbox's PID namespace — every
    process in it, whatever group it moved to."""
    if tree:
        signal_tree(pgid, signal.SIGTERM)
    else:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
    wait(grace)
    if tree:
        signal_tree(pgid, signal.SIGKILL)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    wait(5.0)


class Processes:
    """Every Hermes process the service starts — CLI turns, ACP processes, ``execute``,
    ``--version``, ``gc``'s deletions — and the one owner of what they share: the command,
    the turn slots (:meth:`slot`, both runners and the routes that run a Hermes command hold
    one), the launcher (:meth:`launch`, :mod:`hermes_service.sandbox`), the process groups
    (:attr:`groups`), the run files (:attr:`run_files`), the time limits and toolsets every
    turn gets, and the service's stop state (:attr:`stopping`, :attr:`draining`).

    ``hermes`` is the ``hermes`` section (:class:`~hermes_service.config.HermesSettings`);
    ``command`` is ``hermes.command`` (a name looked up on PATH, or a path).
    """

    def __init__(self, hermes: HermesSettings, pid_dir: Path | None = None,
                 run_dir: Path | None = None, sandbox: Sandbox | None = None,
                 disk: Disk | None = None):
        self.sandbox = sandbox
        self.disk = disk
        self.groups = ProcessGroups(pid_dir)
        self.run_files = RunFiles(run_dir or Path(tempfile.gettempdir()) / "hermes-service-runs")
        #: route family name -> its :class:`~hermes_service.extensions.Family` (set by
        #: :func:`~hermes_service.services.build_services`)
        self.families: dict = {}
        self._slots = Limiter(hermes.cli_slots)   # resizable on reload
        self.configure(hermes)
        self.stopping = False       # set at shutdown: no new Hermes process, no more waiting
        self.draining = False       # set at a drain: routes take no new turn, the ACP pool
                                    # starts no process (docs/operations.md §Process lifetime)
        if disk is not None:
            self.run_files.make_folder = lambda path: disk.make_folder(path, 0o700, True)
        self._version: tuple[float, str] | None = None
        self._version_lock = threading.Lock()

    def command_path(self) -> str:
        """Absolute path of the CLI; raises :class:`Unconfigured` if it cannot be found."""
        found = shutil.which(self.command)
        if not found:
            raise Unconfigured(f"the Hermes command '{self.command}' was not found "
                               "(set hermes.command in config.yaml)", code="hermes_unavailable")
        return found

    @contextmanager
    def slot(self, cancel: threading.Event | None = None):
        """Hold one turn slot (shared by both runners); yields the seconds waited.
        Raises :class:`TooManyRuns` after ``queue_wait_seconds``; while waiting, a set
        ``cancel`` event ends the wait with ``run_cancelled``."""
        started = time.monotonic()
        deadline = started + self.queue_wait
        while not self._slots.acquire(timeout=min(0.2, max(0.0, deadline - time.monotonic()))):
            if self.stopping:
                raise stopping_error()
            if cancel is not None and cancel.is_set():
                raise RunError("the run was aborted", code="run_cancelled", status=409)
            if time.monotonic() >= deadline:
                raise self.too_many_runs()
        try:
            yield time.monotonic() - started
        finally:
            self._slots.release()

    def too_many_runs(self) -> TooManyRuns:
        """The 429 of a turn that found no slot within ``queue_wait_seconds``."""
        return TooManyRuns("too many Hermes runs in progress; retry later",
                           headers={"Retry-After": str(max(1, int(self.timeout // 10)))})

    def try_slot(self) -> bool:
        """Take a turn slot if one is free now (for a caller that cannot block: the ACP
        runner's loop starting a process); give it back with :meth:`release_slot`."""
        return self._slots.acquire(blocking=False)

    def release_slot(self) -> None:
        self._slots.release()

    @property
    def slot_count(self) -> int:
        """Turn slots (``hermes.max_concurrent_runs``)."""
        return self._slots.size

    @property
    def slots_held(self) -> int:
        """Turn slots held now."""
        return self._slots.held

    def toolset_names(self, extra: list[str] | None = None) -> list[str]:
        """``hermes.toolsets`` plus ``extra`` (e.g. an extension plugin's for its runs)."""
        return [*self.toolsets, *(extra or [])]

    def launch(self, args: list[str], env: dict, home: UserHome) -> Launch:
        """How to start ``hermes <args>`` for ``home``: in its sandbox, or unconfined
        (:mod:`hermes_service.sandbox`; ``hermes.sandbox.mode``). The home's run folder is
        visible to it; a sandbox gets ``RLIMIT_FSIZE`` of what is left of the home's quota and
        is watched by the disk watcher while it lives (:mod:`hermes_service.disk.quota`). Raises
        Unconfigured when the command is missing, RunError ``hermes_failed`` when its sandbox
        cannot be made."""
        command = self.command_path()
        if self.sandbox is None:
            return Launch([command, *args], env, str(home.root))
        run_dir = self.run_files.user_dir(home.user_id)
        disk = self.disk if self.sandbox.active else None
        used = disk.measure(home.root, run_dir) if disk is not None else None
        fsize = None if disk is None or used is None else disk.fsize_bytes(
            used, self.sandbox.settings.limits.file_size_mb)
        try:
            launch = self.sandbox.prepare(args, env, home, run_dir, command, fsize_bytes=fsize)
        except OSError as exc:
            raise RunError(f"the sandbox of a Hermes process could not be made ({exc})",
                           code="hermes_failed") from None
        if disk is not None and used is not None:
            disk.watch(launch, home.user_id, home.root, run_dir, used)
        return launch

    @property
    def sandboxed(self) -> bool:
        """Do new Hermes processes run in a sandbox (with its limits)?"""
        return self.sandbox is not None and self.sandbox.active

    def check_turn(self, home: UserHome) -> None:
        """Before Hermes starts a turn for ``home``: the user's token budget
        (:meth:`check_budget`), then the home's disk (:meth:`check_home_quota`)."""
        self.check_budget(home)
        self.check_home_quota(home)

    def check_budget(self, home: UserHome) -> None:
        """Raise ``token_budget_exceeded`` (429) when ``home``'s user has spent its
        ``hermes.limits.daily_tokens`` today (asked of the pass-through, which holds the
        count: ``sandbox.credentials``); nothing without a pass-through."""
        proxy = self.sandbox.credentials if self.sandbox is not None else None
        if proxy is not None:
            try:
                proxy.check_budget(home.user_id)
            except Refusal:
                raise budget_error() from None

    def check_home_quota(self, home: UserHome) -> None:
        """Raise ``home_quota_exceeded`` (507) when ``home`` and its run folder are over
        ``hermes.sandbox.max_home_mb``, ``storage_full`` (507) when the data or homes file
        system is below ``hermes.sandbox.min_free_mb``
        (:meth:`hermes_service.disk.quota.Disk.check_turn`); nothing unsandboxed."""
        if self.sandbox is None or self.disk is None:
            return
        self.disk.check_turn(home.root, self.run_files.root / home.user_id)

    def explain(self, err: RunError, home: UserHome) -> ServiceError:
        """``err`` of a failed turn, or what made Hermes fail: ``token_budget_exceeded`` when
        its user's ``hermes.limits.daily_tokens`` ran out during it (Hermes reports the
        pass-through's 429 as a failed or empty answer); ``home_quota_exceeded`` /
        ``storage_full`` (507) when its home is now at its quota (the agent filled it, and
        Hermes could not write its record: never a 502) or the disk below the floor. The
        Hermes session id it carries is kept."""
        if err.code not in _MAYBE_BUDGET:
            return err
        better: ServiceError | None = None
        proxy = self.sandbox.credentials if self.sandbox is not None else None
        try:
            if proxy is not None:
                proxy.check_budget(home.user_id)
        except Refusal:
            better = budget_error()
        if better is None and self.sandbox is not None and self.disk is not None:
            try:
                self.disk.check_turn(home.root, self.run_files.root / home.user_id)
            except (RunError, StorageFull) as full:
                better = full
        if better is None:
            return err
        better.hermes_session_id = getattr(err, "hermes_session_id", None)
        return better

    def spawn(self, args: list[str], env: dict, home: UserHome,
              max_output_bytes: int | None = None) -> CliProcess:
        """Start ``hermes <args>`` (no shell) for ``home`` in a new process group (in its
        sandbox, :meth:`launch`). Caller holds a slot. The group is recorded in
        :attr:`groups` until it is waited for."""
        if self.stopping:
            raise stopping_error()
        launch = self.launch(args, env, home)
        try:
            proc = CliProcess(launch, max_output_bytes, on_exit=self.groups.forget)
        except OSError as exc:
            raise RunError(f"the Hermes CLI could not be started ({exc.strerror})",
                           code="hermes_failed") from None
        self.groups.add(proc, env.get("HERMES_HOME"))
        return proc

    def kill_all(self) -> int:
        """Kill every live Hermes process group (service shutdown). Returns how many."""
        return self.groups.kill_all("shutdown")

    def reap_orphans(self) -> int:
        """See :meth:`ProcessGroups.reap_orphans`; also drops run files a crash left."""
        self.run_files.sweep(older_than=self.timeout + 60)
        return self.groups.reap_orphans()

    def version(self, env: dict, home: UserHome, ttl: float = 300.0) -> str:
        """First line of ``hermes --version`` (cached ``ttl`` seconds; one refresh at a time,
        within the slots). Raises Unconfigured/RunError/TooManyRuns."""
        with self._version_lock:
            now = time.monotonic()
            if self._version and now - self._version[0] < ttl:
                return self._version[1]
            with self.slot():
                outcome = self.spawn(["--version"], env, home, max_output_bytes=65536).wait(30)
            if outcome.returncode != 0 or not outcome.stdout.strip():
                raise RunError("`hermes --version` failed", code="hermes_failed")
            text = outcome.stdout.strip().splitlines()[0].strip()
            self._version = (now, text)
            return text

    def configure(self, hermes: HermesSettings) -> None:
        """Take a (reloaded) ``hermes`` section for new turns (docs/configuring.md §Reload):
        command, time limits, queue wait, toolsets and the number of turn slots. Turns in flight
        keep what they started with."""
        self.command = hermes.command
        self.timeout = float(hermes.timeout_seconds)
        self.stall_timeout = float(hermes.stall_timeout_seconds)
        self.queue_wait = float(hermes.queue_wait_seconds)
        self.toolsets = (self.sandbox.allowed_toolsets(hermes.toolsets) if self.sandbox
                         else list(hermes.toolsets))
        self._slots.resize(hermes.cli_slots)


"""The Hermes runners' common ground and the CLI runner (README §Runners; measured CLI
facts: docs/hermes-cli-notes.md).

**Turns.** A turn is a :class:`TurnRequest` (message, Hermes session to resume, the user's
home and clean environment, model, toolsets, the mnote run binding, a listener for live
events, a cancel event) answered by a :class:`TurnResult`. Both runners — this module's
CLI runner and :mod:`hermes_service.runner.acp` — take the answer from Hermes's own record
(:func:`hermes_service.hermes_state.turn_record`), never from terminal output: a turn that
recorded no answer fails with ``upstream_empty_answer`` (502).

**CLI runner** (``hermes.runner: cli``, the default). One turn is
``hermes chat --query=<msg> -Q --source tool -t <toolsets> [--resume <id>]`` with stdin
closed, cwd = the user's home, in a new **process group** so a timeout, a stall or an abort
kills the CLI and every child it started. The last stderr line is ``session_id: <id>``; a
turn killed before printing it is matched to its Hermes session by the turn marker the
``hermes_service`` plugin writes at the start of the turn (``HERMES_SERVICE_TURN_FILE``).
On failure (rc != 0) Hermes prints the provider error on stdout; :func:`classify_failure`
turns it into a stable code and the text is logged (warning, with the run's ids).

**Run files.** What the Hermes plugins need for one run (the mnote run token, ids, page
context) is written to ``<data>/runs/<user_id>/`` (0700/0600) for that run only and removed
when it ends: the CLI gets its path in ``MNOTE_RUN_FILE``; an ACP process reads
``<dir>/<ACP session id>.json``.

**Sandbox.** Every Hermes process — CLI turns, ACP processes, ``execute``, ``--version``,
``gc``'s deletions — is started through :meth:`HermesRunner.launch`, i.e. the launcher of
:mod:`hermes_service.sandbox` (one rule): in a bubblewrap sandbox of its own, or unconfined
under ``hermes.sandbox.mode: none``. A sandbox's limits end a turn with
``run_limit_exceeded`` (422); a home over ``hermes.sandbox.max_home_mb`` is refused with
``home_quota_exceeded`` (507) before Hermes starts.

**Limits.** At most ``hermes.max_concurrent_runs`` turns run at once on both runners (per
service process); a caller waits up to ``hermes.queue_wait_seconds`` for a slot, then gets
:class:`~hermes_service.errors.TooManyRuns` (429). Every Hermes process group is recorded in
``<data>/pids/`` while it runs (:class:`ProcessGroups`), so shutdown kills them all and the
next start reaps what a crashed service left.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .. import hermes_state, homefs
from ..errors import RunError, ServiceError, TooManyRuns, Unconfigured
from ..limits import Limiter
from ..instance import alive_pid, proc_start
from ..sandbox import Launch, Sandbox, home_size_mb, limit_signal, signal_tree

if TYPE_CHECKING:
    from ..user_homes import UserHome

log = logging.getLogger("hermes_service.runner")

KILL_GRACE_SECONDS = 1.0
#: A home whose size took longer than this to add up is not walked again for
#: HOME_SIZE_REUSE_SECONDS (``hermes.sandbox.max_home_mb``: a turn per second must not walk
#: 100 000 files each time).
HOME_WALK_SLOW_SECONDS = 0.05
HOME_SIZE_REUSE_SECONDS = 30.0
# `-t` with a real toolset that holds no tools: the model is offered no builtin
# tool at all (an unknown name would print a warning into the answer on stdout).
NO_TOOLSETS = "context_engine"
_SESSION_LINE = re.compile(r"^session_id:\s*(\S+)\s*$")


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

    def __init__(self, launch: "Launch", max_output_bytes: int | None = None, on_exit=None):
        self.launch = launch
        self.argv = launch.argv
        self._on_exit = on_exit
        self.started = time.monotonic()
        self.last_activity = self.started
        self.killed: str | None = None
        self.limit: str | None = None     # which sandbox limit ended it (see sandbox.py)
        self._max = max_output_bytes
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
        buf = self._out[name]
        for chunk in iter(lambda: stream.read1(65536), b""):
            self.last_activity = time.monotonic()
            room = len(chunk) if self._max is None else max(0, self._max - len(buf))
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


def session_id_from_stderr(stderr: str) -> str | None:
    """The Hermes session id from the last non-blank stderr line (``session_id: X``)."""
    for line in reversed(stderr.splitlines()):
        if line.strip():
            m = _SESSION_LINE.match(line.strip())
            return m.group(1) if m else None
    return None


KILLED = {   # why we ended a process group -> (status, code, detail)
    "timeout": (504, "run_timeout", "the Hermes run exceeded its time limit and was killed"),
    "stall": (504, "run_stalled", "the Hermes run produced no output or tool activity and was killed"),
    "cancelled": (409, "run_cancelled", "the run was aborted"),
    "shutdown": (503, "service_stopping", "the service is shutting down; retry"),
    "limit": (422, "run_limit_exceeded", "the Hermes run exceeded a limit of its sandbox"),
}
#: The limit names of ``run_limit_exceeded`` (``hermes.sandbox.limits``), for its detail.
LIMIT_NAMES = {"memory": "memory (hermes.sandbox.limits.memory_mb)",
               "processes": "processes (hermes.sandbox.limits.processes)",
               "cpu": "CPU time (hermes.sandbox.limits.cpu_seconds)",
               "file_size": "file size (hermes.sandbox.limits.file_size_mb)"}


def limit_error(which: str | None) -> RunError:
    """``run_limit_exceeded`` (422) naming the limit (README §Sandbox)."""
    status, code, detail = KILLED["limit"]
    if which in LIMIT_NAMES:
        detail = f"the Hermes run exceeded its sandbox's {LIMIT_NAMES[which]} and was ended"
    return RunError(detail, code=code, status=status)


def home_quota_error(size_mb: float, cap_mb: float) -> RunError:
    """``home_quota_exceeded`` (507): the home is over ``hermes.sandbox.max_home_mb``."""
    return RunError(f"the user's home uses {size_mb:.0f} MB, over its quota of {cap_mb:g} MB "
                    "(hermes.sandbox.max_home_mb); remove files from it", code="home_quota_exceeded",
                    status=507)


def classify_failure(outcome: Outcome) -> ServiceError:
    """Map a failed CLI run to a :class:`ServiceError` with a stable code.

    =====================  ======  ================================================
    code                   status  cause (text Hermes prints, rc != 0)
    =====================  ======  ================================================
    run_timeout            504     our own ``hermes.timeout_seconds`` ran out
    run_stalled            504     no output/tool activity for stall_timeout_seconds
    run_cancelled          409     aborted by a client
    service_stopping       503     the service shut down during the turn
    run_limit_exceeded     422     a sandbox limit (memory, processes, CPU, file size)
    (others)                       see :func:`classify_text`
    =====================  ======  ================================================
    """
    if outcome.killed == "limit":
        return limit_error(outcome.limit)
    if outcome.killed in KILLED:
        status, code, detail = KILLED[outcome.killed]
        return RunError(detail, code=code, status=status,
                        headers={"Retry-After": "5"} if code == "service_stopping" else None)
    if re.search(r"Session not found", outcome.stderr):
        return RunError("unknown Hermes session", code="session_not_found", status=404)
    err = classify_text(outcome.stdout + "\n" + outcome.stderr)
    if err.code == "hermes_failed":
        err.detail = f"the Hermes CLI failed (exit code {outcome.returncode})"
    return err


def classify_text(text: str) -> ServiceError:
    """Map Hermes's own failure text (CLI stdout/stderr, or an ACP reply) to a stable code.

    =====================  ======  ================================================
    code                   status  cause
    =====================  ======  ================================================
    upstream_unauthorized  502     provider answered HTTP 401/403
    upstream_rate_limited  503     provider answered HTTP 429 (Retry-After set)
    upstream_unavailable   502     connection error, provider 5xx or timeout
    hermes_unconfigured    503     no provider configured, or Hermes refused the
                                   configuration (e.g. context_length < 64 000)
    hermes_failed          502     anything else (the text is logged, not returned)
    =====================  ======  ================================================
    """
    if re.search(r"HTTP 40[13]\b|\b401\b.*(unauthori[sz]ed|invalid api key)|AuthenticationError",
                 text, re.I):
        return RunError("the model provider rejected the service's credentials",
                        code="upstream_unauthorized", status=502)
    if re.search(r"HTTP 429\b|RateLimitError|rate limit", text, re.I):
        return RunError("the model provider is rate limiting requests", code="upstream_rate_limited",
                        status=503, headers={"Retry-After": "30"})
    if re.search(r"HTTP 5\d\d\b|Connection error|APIConnectionError|timed out|timeout|"
                 r"InternalServerError|ServiceUnavailable|Bad Gateway", text, re.I):
        return RunError("the model provider is unreachable or failing", code="upstream_unavailable",
                        status=502)
    if re.search(r"Failed to initiali[sz]e agent", text):
        return Unconfigured("Hermes refused the model configuration (see the service log)",
                            code="hermes_unconfigured")
    if re.search(r"no (inference )?provider|not configured|hermes setup|hermes model", text, re.I):
        return Unconfigured("no model provider is configured for Hermes", code="hermes_unconfigured")
    return RunError("the Hermes agent failed", code="hermes_failed", status=502)


def failure_reason(text: str, limit: int = 500) -> str:
    """Hermes's own failure text for the log: its non-blank lines, the ``session_id`` line
    dropped, joined on one line and cut at ``limit`` characters."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not _SESSION_LINE.match(ln.strip())]
    reason = " | ".join(lines)
    return reason if len(reason) <= limit else reason[:limit] + "…"


def _stopping() -> RunError:
    return RunError("the service is shutting down; retry", code="service_stopping", status=503,
                    headers={"Retry-After": "5"})


def empty_answer() -> RunError:
    """The turn ended without an answer in Hermes's record (the model returned nothing)."""
    return RunError("the model returned an empty answer", code="upstream_empty_answer", status=502)


# ---------------------------------------------------------------------------------------
# turns: what both runners take and give


class TurnListener(Protocol):
    """Live events of a turn (all optional; called from the runner's threads).

    ``started(handle)``: Hermes began the turn; ``handle.kill(reason)`` ends it,
    ``handle.touch()`` records activity for the stall watchdog. ``delta(text)``: a piece of
    the answer as the model generates it (ACP runner). ``reasoning(text)``: a piece of the
    model's reasoning. ``tool(event, call_id, name, ok)``: a builtin tool call started
    (``event="tool.started"``) or finished (``"tool.completed"``); mnote tool calls are
    reported by the tool gateway instead.
    """

    def started(self, handle) -> None: ...

    def delta(self, text: str) -> None: ...

    def reasoning(self, text: str) -> None: ...

    def tool(self, event: str, call_id: str | None, name: str | None, ok: bool | None) -> None: ...


@dataclass
class TurnRequest:
    """One turn. ``resume_id``: the Hermes session to continue (None = a new one);
    ``toolsets`` are offered in addition to ``hermes.toolsets``; ``family`` is the route
    family (``v1`` | ``mnote``: separate ACP processes); ``plugin_run`` is the mnote run
    binding (see :mod:`hermes_service.mnote.gateway`) written to the run file; ``approvals``:
    who answers Hermes's questions (a :class:`~hermes_service.runs.Run`: ``ask_approval`` /
    ``answer``), or None: every question is denied (the CLI runner never asks; README
    §Approvals)."""
    message: str
    resume_id: str | None
    home: "UserHome"
    env: dict
    model: str | None = None
    toolsets: list[str] = field(default_factory=list)
    family: str = "v1"
    plugin_run: dict | None = None
    listener: TurnListener | None = None
    cancel: threading.Event | None = None
    log_ctx: dict = field(default_factory=dict)
    approvals: object = None


@dataclass
class TurnResult:
    """A finished, answered turn. ``answer`` and ``reasoning`` come from Hermes's record;
    ``streamed`` says the answer already reached the listener as deltas; ``duration`` and
    ``queue_wait`` are seconds; ``usage`` is the runner's own token report (ACP) or None."""
    answer: str
    hermes_session_id: str | None
    duration: float
    runner: str = "cli"
    reasoning: str | None = None
    resumed: bool = False
    notice: str | None = None
    streamed: bool = False
    usage: dict | None = None
    queue_wait: float = 0.0


class UseCli(Exception):
    """Raised by the ACP runner when it cannot serve a turn (the session was made by the
    CLI, the process pool is full); the CLI runner takes the turn instead."""


LOST_HISTORY_NOTICE = ("the earlier Hermes conversation could not be found; "
                       "a new conversation was started")


def answer_from_record(req: TurnRequest, session_id: str | None, fallback: str = "",
                       limits: bool = False) -> tuple[str, str | None]:
    """(answer, reasoning) of the turn from Hermes's record; ``fallback`` (the CLI's stdout)
    only when the store holds no row of the turn. Raises ``upstream_empty_answer``, and with
    ``limits`` (the turn ran in a sandbox) ``run_limit_exceeded`` when one of its tool
    commands was ended by a sandbox rlimit (CPU time, file size)."""
    record = hermes_state.turn_record(req.home.hermes_home, session_id, req.message)
    if limits and record.tool_limit:
        err = limit_error(record.tool_limit)
        err.hermes_session_id = session_id
        raise err
    if record.found:
        answer, reasoning = record.answer, record.reasoning
    else:
        answer, reasoning = fallback.strip(), None
    if not answer:
        err = empty_answer()
        err.hermes_session_id = session_id
        raise err
    return answer, reasoning


class RunFiles:
    """The per-user folder of run files, ``<data>/runs/<user_id>/`` (0700; files 0600).

    The user's Hermes process can write this folder (its plugins read and write run files
    there), so every access goes through :mod:`hermes_service.homefs`: the folder is opened
    with ``O_NOFOLLOW`` under the trusted ``root`` (a symlink or file in its place is removed
    and the folder made again), files are written by a rename inside it and read without
    following, blocking on a FIFO or reading through a hardlink, and removal never follows."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _open(self, user_id: str) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return homefs.open_dirs(self.root, user_id, create=True, repair=True, mode=0o700)

    def _parent(self, path: Path) -> int:
        path = Path(path)
        if path.parent.parent != self.root:
            raise ValueError(f"{path} is not a run file of {self.root}")
        return self._open(path.parent.name)

    def user_dir(self, user_id: str) -> Path:
        """The user's folder (made, or repaired, here). Raises HomeTampered if it keeps
        being replaced."""
        os.close(self._open(user_id))
        return self.root / user_id

    def write(self, path: Path, data: dict) -> Path:
        """Write ``data`` as JSON atomically with mode 0600 (a throwaway file: not fsynced);
        ``path`` is ``<user_dir>/<name>``."""
        fd = self._parent(path)
        try:
            homefs.write_file(fd, Path(path).name, json.dumps(data, ensure_ascii=False),
                              durable=False, prefix=".run.")
        finally:
            os.close(fd)
        return Path(path)

    def read(self, path: Path, limit: int = 4096) -> bytes | None:
        """A run file's content (at most ``limit`` bytes); None when missing, too large or
        not a plain file (a symlink, FIFO, directory, hardlink: never followed)."""
        try:
            fd = self._parent(path)
        except (OSError, homefs.HomeTampered):
            return None
        try:
            return homefs.read_file(fd, Path(path).name, limit)
        except (OSError, homefs.HomeTampered):
            return None
        finally:
            os.close(fd)

    def remove(self, path: Path) -> None:
        """Remove a run file, whatever its name now holds (a directory too); never raises
        for what the agent put there."""
        try:
            fd = self._parent(path)
        except (OSError, homefs.HomeTampered):
            return
        try:
            homefs.remove(fd, Path(path).name)
        except OSError:
            pass
        finally:
            os.close(fd)

    def sweep(self, older_than: float) -> int:
        """Remove run files older than ``older_than`` seconds — left by a service that died
        (a live turn's file is younger than the turn time limit; another service process may
        share the data dir) — and anything else as old in a user's folder (a planted
        symlink, FIFO or directory), never following one. Returns how many."""
        removed, cutoff = 0, time.time() - older_than
        try:
            users = sorted(e.name for e in os.scandir(self.root))
        except OSError:
            return 0
        for user in users:
            try:
                fd = homefs.open_dirs(self.root, user)
            except (OSError, homefs.HomeTampered):
                continue                  # not a folder: the next turn of the user repairs it
            try:
                for entry in os.scandir(fd):
                    try:
                        if entry.stat(follow_symlinks=False).st_mtime < cutoff \
                                and homefs.remove(fd, entry.name):
                            removed += 1
                    except OSError:
                        continue
            finally:
                os.close(fd)
        return removed


# ---------------------------------------------------------------------------------------
# process groups


class ProcessGroups:
    """Every Hermes process group this service runs (CLI turns, ACP processes), recorded in
    ``<pid_dir>/<pgid>.json`` while alive so :meth:`kill_all` at shutdown and
    :meth:`reap_orphans` after a crash can end them. Members have ``pgid`` and ``kill(reason)``."""

    def __init__(self, pid_dir: Path | None):
        self.pid_dir = pid_dir
        self._live: set = set()
        self._lock = threading.Lock()
        if pid_dir is not None:
            pid_dir.mkdir(parents=True, exist_ok=True)

    def add(self, member, home: str | None) -> None:
        with self._lock:
            self._live.add(member)
        if self.pid_dir is not None:
            (self.pid_dir / f"{member.pgid}.json").write_text(json.dumps({
                "service_pid": os.getpid(), "service_start": proc_start(os.getpid()),
                "leader_start": proc_start(member.pgid), "home": home}))

    def forget(self, member) -> None:
        with self._lock:
            self._live.discard(member)
        if self.pid_dir is not None:
            (self.pid_dir / f"{member.pgid}.json").unlink(missing_ok=True)

    def count(self, kind: type | None = None) -> int:
        with self._lock:
            return sum(1 for m in self._live if kind is None or isinstance(m, kind))

    def kill_all(self, reason: str = "shutdown") -> int:
        """Kill every live process group at once (in parallel). Returns how many."""
        with self._lock:
            live = list(self._live)
        threads = [threading.Thread(target=m.kill, args=(reason,)) for m in live]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return len(live)

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


class HermesRunner:
    """The CLI runner: starts ``hermes chat`` processes within the concurrency limit, and
    owns what both runners share (the command, the slots, the process groups, run files).

    ``command`` is ``hermes.command`` (a name looked up on PATH, or a path).
    """
    name = "cli"

    def __init__(self, hermes_cfg: dict, pid_dir: Path | None = None, run_dir: Path | None = None,
                 sandbox: Sandbox | None = None):
        self.command = hermes_cfg["command"]
        self.sandbox = sandbox
        self.groups = ProcessGroups(pid_dir)
        self.run_files = RunFiles(run_dir or Path(tempfile.gettempdir()) / "hermes-service-runs")
        self.timeout = float(hermes_cfg["timeout_seconds"])
        self.stall_timeout = float(hermes_cfg["stall_timeout_seconds"])
        self.queue_wait = float(hermes_cfg["queue_wait_seconds"])
        self.toolsets = list(hermes_cfg["toolsets"])
        self._slots = Limiter(hermes_cfg["max_concurrent_runs"])   # resizable on reload
        self.stopping = False       # set at shutdown: no new Hermes process, no more waiting
        self.draining = False       # set at a drain: routes take no new turn, the ACP pool
                                    # starts no process (README §Process lifetime)
        self._home_sizes: dict[str, tuple[float, float]] = {}   # user -> (reuse until, MiB)
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
                raise _stopping()
            if cancel is not None and cancel.is_set():
                raise RunError("the run was aborted", code="run_cancelled", status=409)
            if time.monotonic() >= deadline:
                raise TooManyRuns("too many Hermes runs in progress; retry later",
                                  headers={"Retry-After": str(max(1, int(self.timeout // 10)))})
        try:
            yield time.monotonic() - started
        finally:
            self._slots.release()

    def toolset_names(self, extra: list[str] | None = None) -> list[str]:
        """``hermes.toolsets`` plus ``extra`` (e.g. the mnote plugin's for mnote runs)."""
        return [*self.toolsets, *(extra or [])]

    def launch(self, args: list[str], env: dict, home: "UserHome") -> Launch:
        """How to start ``hermes <args>`` for ``home``: in its sandbox, or unconfined
        (:mod:`hermes_service.sandbox`; ``hermes.sandbox.mode``). The home's run folder is
        visible to it. Raises Unconfigured when the command is missing, RunError
        ``hermes_failed`` when its sandbox cannot be made."""
        command = self.command_path()
        if self.sandbox is None:
            return Launch([command, *args], env, str(home.root))
        try:
            return self.sandbox.prepare(args, env, home, self.run_files.user_dir(home.user_id),
                                        command)
        except OSError as exc:
            raise RunError(f"the sandbox of a Hermes process could not be made ({exc})",
                           code="hermes_failed") from None

    @property
    def sandboxed(self) -> bool:
        """Do new Hermes processes run in a sandbox (with its limits)?"""
        return self.sandbox is not None and self.sandbox.active

    def check_home_quota(self, home: "UserHome") -> None:
        """Raise ``home_quota_exceeded`` (507) when the home is over
        ``hermes.sandbox.max_home_mb`` — before Hermes starts."""
        if self.sandbox is None:
            return
        cap = self.sandbox.settings.max_home_mb
        now = time.monotonic()
        cached = self._home_sizes.get(home.user_id)
        if cached is not None and now < cached[0]:
            size = cached[1]
        else:
            # the run folder is the user's too (writable in its sandbox)
            size = home_size_mb(home.root, stop_above=cap)
            size += home_size_mb(self.run_files.root / home.user_id, stop_above=cap)
            took = time.monotonic() - now
            # a home of many files costs a walk of every entry: then reuse it for a while
            if took > HOME_WALK_SLOW_SECONDS:
                self._home_sizes[home.user_id] = (now + HOME_SIZE_REUSE_SECONDS, size)
            else:
                self._home_sizes.pop(home.user_id, None)
        if size > cap:
            raise home_quota_error(size, cap)

    def spawn(self, args: list[str], env: dict, home: "UserHome",
              max_output_bytes: int | None = None) -> CliProcess:
        """Start ``hermes <args>`` (no shell) for ``home`` in a new process group (in its
        sandbox, :meth:`launch`). Caller holds a slot. The group is recorded in
        :attr:`groups` until it is waited for."""
        if self.stopping:
            raise _stopping()
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

    def chat_args(self, message: str, resume_id: str | None, model: str | None = None,
                  toolsets: list[str] | None = None) -> list[str]:
        """argv after the command for one turn (``--query=`` so a leading ``--`` stays text).

        ``toolsets`` are added to ``hermes.toolsets`` (e.g. the mnote plugin's for mnote runs).
        """
        sets = self.toolset_names(toolsets)
        args = ["chat", f"--query={message}", "-Q", "--source", "tool",
                "-t", ",".join(sets) if sets else NO_TOOLSETS]
        if model:
            args += ["-m", model]
        if resume_id:
            args += ["--resume", resume_id]
        return args

    def run_turn(self, req: TurnRequest) -> TurnResult:
        """Run one turn to the end (holding a slot) and return its :class:`TurnResult`.

        An unknown ``resume_id`` is recovered by one fresh run (``resumed=False``, ``notice``
        set). Raises a :class:`ServiceError` from :func:`classify_failure` (carrying
        ``hermes_session_id`` when Hermes saved the turn), ``upstream_empty_answer``,
        :class:`TooManyRuns` or :class:`Unconfigured`.
        """
        with self.slot(req.cancel) as waited:
            result = self.cli_turn(req)
        result.queue_wait = waited
        return result

    def cli_turn(self, req: TurnRequest) -> TurnResult:
        """One CLI turn; the caller holds a slot."""
        user_dir = self.run_files.user_dir(req.home.user_id)
        turn_id = "cli-" + uuid.uuid4().hex
        marker = user_dir / f"{turn_id}.turn"
        env = {**req.env, "HERMES_SERVICE_TURN_FILE": str(marker)}
        run_file = None
        if req.plugin_run is not None:
            run_file = self.run_files.write(user_dir / f"{turn_id}.json", req.plugin_run)
            env["MNOTE_RUN_FILE"] = str(run_file)
        try:
            resume, notice = req.resume_id, None
            self.check_home_quota(req.home)
            outcome = self.run_process(
                self.chat_args(req.message, resume, req.model, req.toolsets), env, req.home,
                _on_spawn(req.listener), req.cancel, req.log_ctx)
            if outcome.returncode != 0 and resume and outcome.killed is None \
                    and classify_failure(outcome).code == "session_not_found":
                log.warning("resume id unknown, starting a fresh Hermes session %s", req.log_ctx)
                notice, resume = LOST_HISTORY_NOTICE, None
                self.run_files.remove(marker)
                outcome = self.run_process(
                    self.chat_args(req.message, None, req.model, req.toolsets), env, req.home,
                    _on_spawn(req.listener), req.cancel, req.log_ctx)
            sid = session_id_from_stderr(outcome.stderr) or _read_marker(marker, self.run_files)
            if outcome.returncode != 0 or outcome.killed:
                err = classify_failure(outcome)
                err.hermes_session_id = sid
                if outcome.killed is None:
                    log.warning("hermes turn failed %s code=%s reason=%s", _ctx(req.log_ctx),
                                err.code, failure_reason(outcome.stdout + "\n" + outcome.stderr))
                raise err
            answer, reasoning = answer_from_record(req, sid, outcome.stdout, limits=self.sandboxed)
            return TurnResult(answer, sid, outcome.duration, runner=self.name, reasoning=reasoning,
                              resumed=bool(resume), notice=notice)
        finally:
            self.run_files.remove(marker)
            if run_file is not None:
                self.run_files.remove(run_file)

    def run_process(self, args: list[str], env, home, on_spawn, cancel, log_ctx) -> Outcome:
        """One CLI process for ``home`` to its end: ``hermes <args>`` with ``env``, reported to
        ``on_spawn(process)``, stopped by a set ``cancel``; returns its :class:`Outcome`.
        The CLI runner's seam: unit tests replace it on the instance with a scripted turn
        (tests/support/fixtures.py ``StubTurns``)."""
        if cancel is not None and cancel.is_set():
            return Outcome(-1, "", "", 0.0, killed="cancelled")
        proc = self.spawn(args, env, home)
        if on_spawn:
            on_spawn(proc)
        outcome = proc.wait(self.timeout, self.stall_timeout, cancel)
        log.info("hermes chat %s rc=%s killed=%s resume=%s", _ctx(log_ctx), outcome.returncode,
                 outcome.killed, "--resume" in args,
                 extra={"status": "ok" if outcome.returncode == 0 and not outcome.killed
                        else classify_failure(outcome).code,
                        "duration_ms": round(outcome.duration * 1000, 1), "runner": "cli"})
        return outcome

    def version(self, env: dict, home: "UserHome", ttl: float = 300.0) -> str:
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


    def reconfigure(self, hermes_cfg: dict) -> None:
        """Apply a reloaded ``hermes`` section to new turns (README §Reload): command, time
        limits, queue wait, toolsets and the number of turn slots. Turns in flight keep what
        they started with."""
        self.command = hermes_cfg["command"]
        self.timeout = float(hermes_cfg["timeout_seconds"])
        self.stall_timeout = float(hermes_cfg["stall_timeout_seconds"])
        self.queue_wait = float(hermes_cfg["queue_wait_seconds"])
        self.toolsets = list(hermes_cfg["toolsets"])
        self._slots.resize(hermes_cfg["max_concurrent_runs"])


def _ctx(log_ctx: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (log_ctx or {}).items())


def _on_spawn(listener):
    return (lambda proc: listener.started(proc)) if listener is not None else None


def _read_marker(path: Path, run_files: RunFiles) -> str | None:
    """The Hermes session id the ``hermes_service`` plugin wrote at the start of the turn
    (read with :meth:`RunFiles.read`: never followed, at most 4 KiB)."""
    data = run_files.read(path)
    text = data.decode("utf-8", "replace").strip() if data else ""
    return text if re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", text) else None

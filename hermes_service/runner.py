"""Runs the real ``hermes`` CLI (issue #2 item 4; measured facts: docs/hermes-cli-notes.md).

One turn is ``hermes chat --query=<msg> -Q --source tool [-t <toolsets>]
[--resume <id>]`` with stdin closed, cwd = the user's home, in a new
**process group** so a timeout, a stall or an abort kills the CLI and every
child it started. stdout carries only the answer; the last stderr line is
``session_id: <id>``. On failure (rc != 0) Hermes prints the provider error
on stdout; :func:`classify_failure` turns it into a stable code.

At most ``hermes.max_concurrent_runs`` CLI processes run at once (per
service process); a caller waits up to ``hermes.queue_wait_seconds`` for a
slot, then gets :class:`~hermes_service.errors.TooManyRuns` (429).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import RunError, ServiceError, TooManyRuns, Unconfigured

log = logging.getLogger("hermes_service.runner")

KILL_GRACE_SECONDS = 1.0
# `-t` with a real toolset that holds no tools: the model is offered no builtin
# tool at all (an unknown name would print a warning into the answer on stdout).
NO_TOOLSETS = "context_engine"
_SESSION_LINE = re.compile(r"^session_id:\s*(\S+)\s*$")


@dataclass
class ChatResult:
    """A finished, successful turn. ``duration`` in seconds."""
    answer: str
    hermes_session_id: str | None
    returncode: int
    duration: float
    resumed: bool = False
    notice: str | None = None


@dataclass
class Outcome:
    """What a finished :class:`CliProcess` left: exit code, output, and why it was killed (if)."""
    returncode: int
    stdout: str
    stderr: str
    duration: float
    killed: str | None = None        # "timeout" | "stall" | "cancelled" | None
    truncated: bool = False


class CliProcess:
    """One CLI process in its own process group, with output readers and kill support.

    ``touch()`` records activity from outside (e.g. a tool call) for the
    stall watchdog. ``kill(reason)`` terminates the whole process group
    (SIGTERM, then SIGKILL after ``KILL_GRACE_SECONDS``) and is idempotent.
    """

    def __init__(self, argv: list[str], env: dict, cwd: str, max_output_bytes: int | None = None,
                 on_exit=None):
        self.argv = argv
        self._on_exit = on_exit
        self.started = time.monotonic()
        self.last_activity = self.started
        self.killed: str | None = None
        self._max = max_output_bytes
        self._out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._truncated = False
        self._kill_lock = threading.Lock()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
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
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(grace)
                if sig == signal.SIGTERM:
                    # the leader is gone; make sure no child it left survives
                    os.killpg(self.pgid, signal.SIGKILL)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break

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
            if cancel is not None and cancel.is_set():
                self.kill("cancelled")
            elif deadline and now >= deadline:
                self.kill("timeout")
            elif stall_timeout and now - self.last_activity >= stall_timeout:
                self.kill("stall")
        for t in self._readers:
            t.join(5)
        if self._on_exit:
            self._on_exit(self)
        text = {k: v.decode("utf-8", "replace") for k, v in self._out.items()}
        return Outcome(self.proc.returncode, text["stdout"], text["stderr"],
                       time.monotonic() - self.started, self.killed, self._truncated)


def _proc_start(pid) -> str | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; None otherwise."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, TypeError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[1].split()   # after "(comm)": state, ppid, ...
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(pid, started: str | None) -> bool:
    """Is the service process that wrote a record still running (same pid, same start)?"""
    now = _proc_start(pid)
    return now is not None and (started is None or now == started)


def session_id_from_stderr(stderr: str) -> str | None:
    """The Hermes session id from the last non-blank stderr line (``session_id: X``)."""
    for line in reversed(stderr.splitlines()):
        if line.strip():
            m = _SESSION_LINE.match(line.strip())
            return m.group(1) if m else None
    return None


def classify_failure(outcome: Outcome) -> ServiceError:
    """Map a failed CLI run to a :class:`ServiceError` with a stable code.

    =====================  ======  ================================================
    code                   status  cause (text Hermes prints, rc != 0)
    =====================  ======  ================================================
    run_timeout            504     our own ``hermes.timeout_seconds`` ran out
    run_stalled            504     no output/tool activity for stall_timeout_seconds
    run_cancelled          409     aborted by a client
    upstream_unauthorized  502     provider answered HTTP 401/403
    upstream_rate_limited  503     provider answered HTTP 429 (Retry-After set)
    upstream_unavailable   502     connection error, provider 5xx or timeout
    hermes_unconfigured    503     no provider/model configured in the home
    session_not_found      404     ``--resume`` id unknown (recovered by the caller)
    hermes_failed          502     anything else (tail of stderr in the log only)
    =====================  ======  ================================================
    """
    if outcome.killed == "timeout":
        return RunError("the Hermes run exceeded its time limit and was killed", code="run_timeout",
                        status=504)
    if outcome.killed == "stall":
        return RunError("the Hermes run produced no output or tool activity and was killed",
                        code="run_stalled", status=504)
    if outcome.killed == "cancelled":
        return RunError("the run was aborted", code="run_cancelled", status=409)
    if outcome.killed == "shutdown":
        return RunError("the service is shutting down; retry", code="service_stopping", status=503,
                        headers={"Retry-After": "5"})
    text = outcome.stdout + "\n" + outcome.stderr
    if re.search(r"Session not found", outcome.stderr):
        return RunError("unknown Hermes session", code="session_not_found", status=404)
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
    if re.search(r"no (inference )?provider|not configured|hermes setup|hermes model", text, re.I):
        return Unconfigured("no model provider is configured for Hermes", code="hermes_unconfigured")
    return RunError(f"the Hermes CLI failed (exit code {outcome.returncode})", code="hermes_failed",
                    status=502)


class HermesRunner:
    """Starts CLI processes within the concurrency limit.

    ``command`` is ``hermes.command`` (a name looked up on PATH, or a path).
    """

    def __init__(self, hermes_cfg: dict, pid_dir: Path | None = None):
        self.command = hermes_cfg["command"]
        self.pid_dir = pid_dir
        self._live: set[CliProcess] = set()
        self._live_lock = threading.Lock()
        if pid_dir is not None:
            pid_dir.mkdir(parents=True, exist_ok=True)
        self.timeout = float(hermes_cfg["timeout_seconds"])
        self.stall_timeout = float(hermes_cfg["stall_timeout_seconds"])
        self.queue_wait = float(hermes_cfg["queue_wait_seconds"])
        self.toolsets = list(hermes_cfg["toolsets"])
        self._slots = threading.BoundedSemaphore(hermes_cfg["max_concurrent_runs"])
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
        """Hold one CLI slot; raises :class:`TooManyRuns` after ``queue_wait_seconds``.

        While waiting, a set ``cancel`` event ends the wait with ``run_cancelled``.
        """
        deadline = time.monotonic() + self.queue_wait
        while not self._slots.acquire(timeout=min(0.2, max(0.0, deadline - time.monotonic()))):
            if cancel is not None and cancel.is_set():
                raise RunError("the run was aborted", code="run_cancelled", status=409)
            if time.monotonic() >= deadline:
                raise TooManyRuns("too many Hermes runs in progress; retry later",
                                  headers={"Retry-After": str(max(1, int(self.timeout // 10)))})
        try:
            yield
        finally:
            self._slots.release()

    def spawn(self, args: list[str], env: dict, cwd: str, max_output_bytes: int | None = None
              ) -> CliProcess:
        """Start ``hermes <args>`` (no shell) in a new process group. Caller holds a slot.

        The process group is recorded (``<pid_dir>/<pgid>.json``) until it is waited for,
        so :meth:`kill_all` at shutdown and :meth:`reap_orphans` after a crash can end it.
        """
        try:
            proc = CliProcess([self.command_path(), *args], env, cwd, max_output_bytes,
                              on_exit=self._forget)
        except OSError as exc:
            raise RunError(f"the Hermes CLI could not be started ({exc.strerror})",
                           code="hermes_failed") from None
        with self._live_lock:
            self._live.add(proc)
        if self.pid_dir is not None:
            (self.pid_dir / f"{proc.pgid}.json").write_text(json.dumps({
                "service_pid": os.getpid(), "service_start": _proc_start(os.getpid()),
                "home": env.get("HERMES_HOME")}))
        return proc

    def running(self) -> int:
        """CLI processes running now (turns, execute, version) — the metrics gauge."""
        with self._live_lock:
            return len(self._live)

    def _forget(self, proc: CliProcess) -> None:
        with self._live_lock:
            self._live.discard(proc)
        if self.pid_dir is not None:
            (self.pid_dir / f"{proc.pgid}.json").unlink(missing_ok=True)

    def kill_all(self) -> int:
        """Kill every live CLI process group (service shutdown). Returns how many."""
        with self._live_lock:
            live = list(self._live)
        threads = [threading.Thread(target=p.kill, args=("shutdown",)) for p in live]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return len(live)

    def reap_orphans(self) -> int:
        """Kill CLI process groups left by a service process that died (kill -9, crash).

        A record is acted on only if its service process is gone and the group leader is
        still a CLI run of this data dir (its HERMES_HOME matches), so a reused pid is safe.
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
            if _alive(info.get("service_pid"), info.get("service_start")):
                continue
            home = (info.get("home") or "").encode()
            try:
                environ = Path(f"/proc/{pgid}/environ").read_bytes()
            except OSError:
                environ = b""
            if home and b"HERMES_HOME=" + home + b"\0" in environ:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                    reaped += 1
                except ProcessLookupError:
                    pass
            record.unlink(missing_ok=True)
        return reaped

    def chat_args(self, message: str, resume_id: str | None, model: str | None = None,
                  toolsets: list[str] | None = None) -> list[str]:
        """argv after the command for one turn (``--query=`` so a leading ``--`` stays text).

        ``toolsets`` are added to ``hermes.toolsets`` (e.g. the mnote plugin's for mnote runs).
        """
        sets = [*self.toolsets, *(toolsets or [])]
        args = ["chat", f"--query={message}", "-Q", "--source", "tool",
                "-t", ",".join(sets) if sets else NO_TOOLSETS]
        if model:
            args += ["-m", model]
        if resume_id:
            args += ["--resume", resume_id]
        return args

    def run_chat(self, message: str, resume_id: str | None, env: dict, cwd: str,
                 on_spawn=None, cancel: threading.Event | None = None,
                 log_ctx: dict | None = None, model: str | None = None,
                 toolsets: list[str] | None = None) -> ChatResult:
        """Run one turn to the end and return its :class:`ChatResult`.

        ``on_spawn(proc)`` is called with each :class:`CliProcess` started (for
        abort/tool activity). An unknown ``resume_id`` is recovered by one fresh
        run (``resumed=False``, ``notice`` set). Raises a :class:`ServiceError`
        from :func:`classify_failure`, or :class:`TooManyRuns`/:class:`Unconfigured`.
        """
        def turn(resume):
            return self._turn(self.chat_args(message, resume, model, toolsets), env, cwd,
                              on_spawn, cancel, log_ctx)

        with self.slot(cancel):
            outcome = turn(resume_id)
            notice = None
            if outcome.returncode != 0 and resume_id and outcome.killed is None:
                err = classify_failure(outcome)
                if err.code == "session_not_found":
                    log.warning("resume id unknown, starting a fresh Hermes session %s", log_ctx)
                    notice = ("the earlier Hermes conversation could not be found; "
                              "a new conversation was started")
                    resume_id = None
                    outcome = turn(None)
        if outcome.returncode != 0 or outcome.killed:
            err = classify_failure(outcome)
            err.hermes_session_id = session_id_from_stderr(outcome.stderr)
            raise err
        return ChatResult(outcome.stdout.strip("\n"), session_id_from_stderr(outcome.stderr),
                          outcome.returncode, outcome.duration, resumed=bool(resume_id),
                          notice=notice)

    def _turn(self, args: list[str], env, cwd, on_spawn, cancel, log_ctx) -> Outcome:
        """One CLI process to its end (the seam unit tests replace)."""
        if cancel is not None and cancel.is_set():
            return Outcome(-1, "", "", 0.0, killed="cancelled")
        proc = self.spawn(args, env, cwd)
        if on_spawn:
            on_spawn(proc)
        outcome = proc.wait(self.timeout, self.stall_timeout, cancel)
        log.info("hermes chat %s rc=%s killed=%s resume=%s",
                 " ".join(f"{k}={v}" for k, v in (log_ctx or {}).items()), outcome.returncode,
                 outcome.killed, "--resume" in args,
                 extra={"status": "ok" if outcome.returncode == 0 and not outcome.killed
                        else classify_failure(outcome).code,
                        "duration_ms": round(outcome.duration * 1000, 1), "runner": "cli"})
        if outcome.returncode != 0:
            log.debug("hermes chat failed; stderr tail: %s", outcome.stderr[-2000:])
        return outcome

    def version(self, env: dict, cwd: str, ttl: float = 300.0) -> str:
        """First line of ``hermes --version`` (cached ``ttl`` seconds; one refresh at a time,
        within the CLI slots). Raises Unconfigured/RunError/TooManyRuns."""
        with self._version_lock:
            now = time.monotonic()
            if self._version and now - self._version[0] < ttl:
                return self._version[1]
            with self.slot():
                outcome = self.spawn(["--version"], env, cwd, max_output_bytes=65536).wait(30)
            if outcome.returncode != 0 or not outcome.stdout.strip():
                raise RunError("`hermes --version` failed", code="hermes_failed")
            text = outcome.stdout.strip().splitlines()[0].strip()
            self._version = (now, text)
            return text

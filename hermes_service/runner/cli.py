"""The CLI runner (README §Runners; measured CLI facts: docs/hermes-cli-notes.md).

**CLI runner** (``hermes.runner: cli``, the default). One turn is
``hermes chat --query=<msg> -Q --source tool -t <toolsets> [--resume <id>]`` with stdin
closed, cwd = the user's home, in a new **process group** so a timeout, a stall or an abort
kills the CLI and every child it started. The last stderr line is ``session_id: <id>``; a
turn killed before printing it is matched to its Hermes session by the turn marker the
``hermes_service`` plugin writes at the start of the turn (``HERMES_SERVICE_TURN_FILE``).
On failure (rc != 0) Hermes prints the provider error on stdout; :func:`classify_failure`
turns it into a stable code and the text is logged (warning, with the run's ids).
"""
from __future__ import annotations

import logging
import re
import shutil
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RunError, TooManyRuns, Unconfigured
from ..limits import Limiter
from ..sandbox import Launch, Sandbox, home_size_mb
from .failures import _SESSION_LINE, classify_failure, failure_reason
from .processes import CliProcess, Outcome, ProcessGroups, _stopping, home_quota_error
from .protocol import LOST_HISTORY_NOTICE, TurnRequest, TurnResult, _ctx, answer_from_record
from .run_files import RunFiles

if TYPE_CHECKING:
    from ..user_homes import UserHome

log = logging.getLogger("hermes_service.runner")

#: A home whose size took longer than this to add up is not walked again for
#: HOME_SIZE_REUSE_SECONDS (``hermes.sandbox.max_home_mb``: a turn per second must not walk
#: 100 000 files each time).
HOME_WALK_SLOW_SECONDS = 0.05
HOME_SIZE_REUSE_SECONDS = 30.0
# `-t` with a real toolset that holds no tools: the model is offered no builtin
# tool at all (an unknown name would print a warning into the answer on stdout).
NO_TOOLSETS = "context_engine"


def session_id_from_stderr(stderr: str) -> str | None:
    """The Hermes session id from the last non-blank stderr line (``session_id: X``)."""
    for line in reversed(stderr.splitlines()):
        if line.strip():
            m = _SESSION_LINE.match(line.strip())
            return m.group(1) if m else None
    return None


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


def _on_spawn(listener):
    return (lambda proc: listener.started(proc)) if listener is not None else None


def _read_marker(path: Path, run_files: RunFiles) -> str | None:
    """The Hermes session id the ``hermes_service`` plugin wrote at the start of the turn
    (read with :meth:`RunFiles.read`: never followed, at most 4 KiB)."""
    data = run_files.read(path)
    text = data.decode("utf-8", "replace").strip() if data else ""
    return text if re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", text) else None

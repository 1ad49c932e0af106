"""The CLI runner (docs/runners.md; measured CLI facts: docs/hermes-cli-notes.md).

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
import uuid
from pathlib import Path

from ..hermes_site import run_binding
from .failures import SESSION_LINE, classify_failure, failure_reason
from .processes import Outcome, Processes
from .protocol import LOST_HISTORY_NOTICE, TurnRequest, TurnResult, answer_from_record, context_text
from .run_files import RunFiles

log = logging.getLogger("hermes_service.runner")

# `-t` with a real toolset that holds no tools: the model is offered no builtin
# tool at all (an unknown name would print a warning into the answer on stdout).
NO_TOOLSETS = "context_engine"


def session_id_from_stderr(stderr: str) -> str | None:
    """The Hermes session id from the last non-blank stderr line (``session_id: X``)."""
    for line in reversed(stderr.splitlines()):
        if line.strip():
            m = SESSION_LINE.match(line.strip())
            return m.group(1) if m else None
    return None


class CliRunner:
    """The CLI runner: one ``hermes chat`` process per turn, started through
    ``processes`` (:class:`~hermes_service.runner.processes.Processes`: the slot, the
    sandbox, the process group, the run files, the time limits and toolsets)."""
    name = "cli"

    def __init__(self, processes: Processes):
        self.processes = processes

    def chat_args(self, message: str, resume_id: str | None, model: str | None = None,
                  toolsets: list[str] | None = None) -> list[str]:
        """argv after the command for one turn (``--query=`` so a leading ``--`` stays text).

        ``toolsets`` are added to ``hermes.toolsets`` (e.g. an extension plugin's for its runs).
        """
        sets = self.processes.toolset_names(toolsets)
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
        with self.processes.slot(req.cancel) as waited:
            result = self.cli_turn(req)
        result.queue_wait = waited
        return result

    def cli_turn(self, req: TurnRequest) -> TurnResult:
        """One CLI turn; the caller holds a slot."""
        user_dir = self.processes.run_files.user_dir(req.home.user_id)
        turn_id = "cli-" + uuid.uuid4().hex
        marker = user_dir / f"{turn_id}.turn"
        env = {**req.env, "HERMES_SERVICE_TURN_FILE": str(marker)}
        if req.plugin_run is not None:    # in Hermes's memory only (hermes_site/run_binding.py)
            env[run_binding.ENV] = run_binding.encode(req.plugin_run)
        try:
            resume, notice = req.resume_id, None
            self.processes.check_turn(req.home)
            outcome = self.run_process(
                self.chat_args(req.message, resume, req.model, req.toolsets), env, req.home,
                _on_spawn(req.listener), req.cancel, req.log_ctx)
            if outcome.returncode != 0 and resume and outcome.killed is None \
                    and classify_failure(outcome).code == "session_not_found":
                log.warning("resume id unknown, starting a fresh Hermes session %s", req.log_ctx)
                notice, resume = LOST_HISTORY_NOTICE, None
                self.processes.run_files.remove(marker)
                outcome = self.run_process(
                    self.chat_args(req.message, None, req.model, req.toolsets), env, req.home,
                    _on_spawn(req.listener), req.cancel, req.log_ctx)
            sid = session_id_from_stderr(outcome.stderr) \
                or _read_marker(marker, self.processes.run_files)
            if outcome.returncode != 0 or outcome.killed:
                err = classify_failure(outcome)
                err.hermes_session_id = sid
                if outcome.killed is None:
                    log.warning("hermes turn failed %s code=%s reason=%s",
                                context_text(req.log_ctx), err.code,
                                failure_reason(outcome.stdout + "\n" + outcome.stderr))
                raise err
            answer = answer_from_record(req, sid, outcome.stdout, limits=self.processes.sandboxed)
            return TurnResult(answer.text, sid, outcome.duration, runner=self.name,
                              reasoning=answer.reasoning, resumed=bool(resume), notice=notice,
                              finish_reason=answer.finish_reason)
        finally:
            self.processes.run_files.remove(marker)

    def run_process(self, args: list[str], env, home, on_spawn, cancel, log_ctx) -> Outcome:
        """One CLI process for ``home`` to its end: ``hermes <args>`` with ``env``, reported to
        ``on_spawn(process)``, stopped by a set ``cancel``; returns its :class:`Outcome`.
        The CLI runner's seam: unit tests replace it on the instance with a scripted turn
        (tests/support/fixtures.py ``StubTurns``)."""
        if cancel is not None and cancel.is_set():
            return Outcome(-1, "", "", 0.0, killed="cancelled")
        proc = self.processes.spawn(args, env, home)
        if on_spawn:
            on_spawn(proc)
        outcome = proc.wait(self.processes.timeout, self.processes.stall_timeout, cancel)
        log.info("hermes chat %s rc=%s killed=%s resume=%s", context_text(log_ctx),
                 outcome.returncode, outcome.killed, "--resume" in args,
                 extra={"status": "ok" if outcome.returncode == 0 and not outcome.killed
                        else classify_failure(outcome).code,
                        "duration_ms": round(outcome.duration * 1000, 1), "runner": "cli"})
        return outcome


def _on_spawn(listener):
    return (lambda proc: listener.started(proc)) if listener is not None else None


def _read_marker(path: Path, run_files: RunFiles) -> str | None:
    """The Hermes session id the ``hermes_service`` plugin wrote at the start of the turn
    (read with :meth:`RunFiles.read`: never followed, at most 4 KiB)."""
    data = run_files.read(path)
    text = data.decode("utf-8", "replace").strip() if data else ""
    return text if re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", text) else None

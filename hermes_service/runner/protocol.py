"""The turn protocol: what both runners take and give (docs/runners.md).

**Turns.** A turn is a :class:`TurnRequest` (message, Hermes session to resume, the user's
home and clean environment, model, toolsets, the plugin's run binding, a listener for live
events, a cancel event) answered by a :class:`TurnResult`. Both runners — the CLI runner
(:mod:`.cli`) and the ACP runner (:mod:`.acp`) — take the answer from Hermes's own record
(:func:`hermes_service.homes.hermes_state.turn_record`), never from terminal output: a turn that
recorded no answer fails with ``upstream_empty_answer`` (502).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..homes import hermes_state
from .failures import empty_answer, limit_error

if TYPE_CHECKING:
    from ..homes.users import UserHome


class TurnListener(Protocol):
    """Live events of a turn (all optional; called from the runner's threads).

    ``started(handle)``: Hermes began the turn; ``handle.kill(reason)`` ends it,
    ``handle.touch()`` records activity for the stall watchdog. ``delta(text)``: a piece of
    the answer as the model generates it (ACP runner). ``reasoning(text)``: a piece of the
    model's reasoning. ``tool(event, call_id, name, ok, preview)``: a builtin tool call
    started (``event="tool.started"``) or finished (``"tool.completed"``): ``name`` the tool's
    own name (``terminal``, ``read_file``…, None when unknown), ``preview`` what the call does
    (its command, path…, secrets redacted; or None); the tool calls a family reports itself
    (``Family.own_tool_prefix``) are not.
    """

    def started(self, handle) -> None: ...

    def delta(self, text: str) -> None: ...

    def reasoning(self, text: str) -> None: ...

    def tool(self, event: str, call_id: str | None, name: str | None, ok: bool | None,
             preview: str | None = None) -> None: ...


class Questions(Protocol):
    """Who answers Hermes's questions during a turn (docs/mnote-client.md §Approvals): an
    extension's run, on the ACP runner. An ``ask_*`` call puts a question to the user and
    returns ``(question id, future)`` — the future's result is the answer — or None when the
    run is ending (the runner then denies, or tells Hermes nobody answered). The runner
    resolves a question nobody answered in time with ``answer(id, "deny", "timeout")`` or
    ``answer_clarify(id, None, "timeout")``; both raise
    :class:`~hermes_service.errors.Conflict` when the user answered first."""

    def ask_approval(self, kind: str, title: str, detail: str,
                     choices: list[str]) -> tuple[str, Future] | None:
        """``kind``: ``command`` | ``edit`` | ``other``; ``choices``: of ``once``,
        ``session``, ``always``, ``deny``. The future's result is the choice."""

    def answer(self, approval_id: str, choice: str, resolved_by: str = "user") -> str: ...

    def ask_clarify(self, question: str,
                    choices: list[str] | None) -> tuple[str, Future] | None:
        """``choices``: suggested answers, or None for an open question. The future's result
        is the answer text, or None when nobody answered."""

    def answer_clarify(self, clarify_id: str, answer: str | None,
                       resolved_by: str = "user") -> None: ...


@dataclass
class TurnRequest:
    """One turn. ``resume_id``: the Hermes session to continue (None = a new one);
    ``toolsets`` are offered in addition to ``hermes.toolsets``; ``family`` is the route
    family (``v1`` or an extension's: separate ACP processes); ``plugin_run`` is the run
    binding of the family's Hermes plugin (a JSON object; it reaches that Hermes process's
    memory only: ``hermes_site/run_binding.py``); ``approvals``: who answers Hermes's
    questions (:class:`Questions`), or None: every question is denied (the CLI runner never
    asks; docs/mnote-client.md §Approvals); ``log_ctx``: the fields every log line of the
    turn names (user, session, family and what the caller adds, e.g. its run)."""
    message: str
    resume_id: str | None
    home: UserHome
    env: dict
    model: str | None = None
    toolsets: list[str] = field(default_factory=list)
    family: str = "v1"
    plugin_run: dict | None = None
    listener: TurnListener | None = None
    cancel: threading.Event | None = None
    log_ctx: dict = field(default_factory=dict)
    approvals: Questions | None = None


@dataclass
class TurnResult:
    """A finished, answered turn. ``answer``, ``reasoning`` and ``finish_reason`` (why the
    answer ended: ``stop``, ``length`` — cut at the provider's output limit —, …; None when
    Hermes recorded none) come from Hermes's record; ``streamed`` says the answer already
    reached the listener as deltas (which add up to it); ``duration`` and ``queue_wait`` are
    seconds; ``usage`` is the runner's own token report (ACP) or None."""
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
    finish_reason: str | None = None


#: why an answer ended, in a reply (docs/v1-api.md; the client proxy's run.completed)
FINISH_REASON: dict = {"type": ["string", "null"],
                 "pattern": f"^{hermes_state.FINISH_REASON_PATTERN}$",
                 "description": "why the answer ended, as the provider said and Hermes recorded "
                                "it: `stop` (whole), `length` (cut at the provider's output "
                                "limit, also after the continuations Hermes asked for: the "
                                "answer is incomplete), `content_filter`, …; null when unknown",
                 "examples": ["stop", "length"]}


class Answer(NamedTuple):
    """A turn's answer as :func:`answer_from_record` reads it."""
    text: str
    reasoning: str | None
    finish_reason: str | None


class UseCli(Exception):
    """Raised by the ACP runner when it cannot serve a turn (the session was made by the
    CLI, the process pool is full); the CLI runner takes the turn instead."""


LOST_HISTORY_NOTICE = ("the earlier Hermes conversation could not be found; "
                       "a new conversation was started")


def answer_from_record(req: TurnRequest, session_id: str | None, fallback: str = "",
                       limits: bool = False) -> Answer:
    """The turn's :class:`Answer` from Hermes's record; ``fallback`` (the CLI's stdout) only
    when the store holds no row of the turn (then no reasoning, no finish reason). Raises
    ``upstream_empty_answer``, and with ``limits`` (the turn ran in a sandbox)
    ``run_limit_exceeded`` when one of its tool commands was ended by a sandbox rlimit (CPU
    time, file size)."""
    record = hermes_state.turn_record(req.home.hermes_home, session_id, req.message)
    if limits and record.tool_limit:
        err = limit_error(record.tool_limit)
        err.hermes_session_id = session_id
        raise err
    if record.found:
        answer = Answer(record.answer, record.reasoning, record.finish_reason)
    else:
        answer = Answer(fallback.strip(), None, None)
    if not answer.text:
        err = empty_answer()
        err.hermes_session_id = session_id
        raise err
    return answer


def context_text(log_ctx: dict | None) -> str:
    """A turn's log context as ``key=value`` words for a log line."""
    return " ".join(f"{k}={v}" for k, v in (log_ctx or {}).items())

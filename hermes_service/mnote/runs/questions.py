"""A run's questions to its user (docs/mnote-client.md §Approvals): an ``approval.request``
before a dangerous command or an edit, a ``clarify.request`` of Hermes's ``clarify`` tool,
each resolved once — by the user, a timeout or an abort — across every process on the data
dir (:meth:`~.log.RunLogs.claim`). A :class:`~.run.Run` has its :class:`RunQuestions` and
answers :class:`hermes_service.runner.Questions` with them."""
from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import BadRequest, Conflict
from .. import metrics

if TYPE_CHECKING:
    from .log import RunLogs

log = logging.getLogger("hermes_service.runs")


@dataclass
class Question:
    """One pending question of a run: its id, the choices it accepts and the Future the
    asking runner waits on (its result: the choice)."""
    question_id: str
    choices: list[str] | None
    kind: str = "approval"           # approval | clarify
    future: Future = field(default_factory=Future)


def not_pending(question_id: str, kind: str = "approval") -> Conflict:
    """409 ``approval_not_pending`` / ``clarify_not_pending`` (docs/mnote-client.md §Approvals)."""
    what = "approval" if kind == "approval" else "question"
    return Conflict(f"{what} {question_id} is not pending (never asked, already answered, "
                    "timed out, or the run ended)", code=f"{kind}_not_pending")


class Asking(Protocol):
    """What a run's questions need of their run (:class:`~.run.Run`): its id, lock, events,
    status, abort and the durable claims of answers."""
    run_id: str
    status: str
    cancel: threading.Event
    claims: RunLogs | None

    @property
    def done(self) -> bool: ...
    @property
    def lock(self) -> threading.Condition: ...
    def emit(self, event: str, **fields) -> int: ...


class RunQuestions:
    """The questions of ``run`` to its user, pending in :attr:`pending` (id →
    :class:`Question`); under the run's lock, on its stream of events."""

    def __init__(self, run: Asking):
        self.run = run
        self.pending: dict[str, Question] = {}

    def ask_approval(self, kind: str, title: str, detail: str,
                     choices: list[str]) -> tuple[str, Future] | None:
        """Put a question to the user: emits ``approval.request`` and sets the status to
        ``waiting_for_approval``. Returns ``(approval_id, future)`` — the future's result is
        the choice, set by :meth:`answer` — or None when the run is ending (aborted or
        finished: the caller denies)."""
        with self.run.lock:
            if self.run.done or self.run.cancel.is_set():
                return None
            question = Question("apr_" + secrets.token_hex(12), list(choices))
            self.pending[question.question_id] = question
            self._waiting()
            self.run.emit("approval.request", approval_id=question.question_id, kind=kind,
                          title=title, detail=detail, choices=list(choices))
        metrics.approval_asked(kind)
        return question.question_id, question.future

    def answer(self, approval_id: str, choice: str, resolved_by: str = "user",
               claimed: bool = False) -> str:
        """Resolve a pending question with ``choice`` (one of its choices): emits
        ``approval.responded`` and hands the choice to the waiting runner; the status is
        ``running`` again once no question is pending. Returns the choice.

        Exactly one answer wins across the processes of the data dir: the answer is claimed
        first (:meth:`RunLogs.claim`; ``claimed``: another process already claimed it for
        this one). When another answer won the claim, that answer is applied here and this
        one is refused like an answer to a question no longer pending.

        Raises BadRequest ``invalid_request`` for a choice the question does not offer,
        Conflict ``approval_not_pending`` for an id that is not pending (never asked,
        already answered — here or in another process —, timed out, or the run ended)."""
        with self.run.lock:
            question = self._pending_question(approval_id, "approval")
            choices = question.choices or []
            if choice not in choices:
                raise BadRequest(f"choice must be one of {', '.join(choices)}",
                                 code="invalid_request")
            self._settle(question, choice, resolved_by, claimed,
                         lambda won: won if won in choices else "deny")
        return choice

    def _claim(self, question_id: str, value, resolved_by: str) -> dict | None:
        """Claim the answer (under the run's lock): None when it is this one (or no other process
        can answer: no durable log), else the answer that won."""
        if self.run.claims is None:
            return None
        try:
            return self.run.claims.claim(self.run.run_id, question_id,
                                     {"value": value, "resolved_by": resolved_by})
        except (OSError, ValueError):
            log.exception("run %s: could not record the answer to %s", self.run.run_id, question_id)
            return None

    def _resolve(self, question: Question, value, resolved_by: str) -> None:
        """Hand ``value`` to the waiting runner and say so on the stream (under the run's lock)."""
        del self.pending[question.question_id]
        self._waiting()
        if question.kind == "approval":
            self.run.emit("approval.responded", approval_id=question.question_id, choice=value,
                          resolved_by=resolved_by)
            metrics.approval_answered(resolved_by, value)
        else:
            self.run.emit("clarify.responded", clarify_id=question.question_id,
                          resolved_by=resolved_by)
            metrics.approval_answered(resolved_by, "answer" if value is not None else "none")
        question.future.set_result(value)

    def ask_clarify(self, question: str, choices: list[str] | None) -> tuple[str, Future] | None:
        """Put a clarifying question to the user: emits ``clarify.request`` (``choices``:
        suggested answers, or None for an open question; any text is an answer) and sets the
        status to ``waiting_for_answer``. Returns ``(clarify_id, future)`` — the future's
        result is the answer text, or None when nobody answered — or None when the run is
        ending."""
        with self.run.lock:
            if self.run.done or self.run.cancel.is_set():
                return None
            asked = Question("clq_" + secrets.token_hex(12),
                             list(choices) if choices else None, kind="clarify")
            self.pending[asked.question_id] = asked
            self._waiting()
            self.run.emit("clarify.request", clarify_id=asked.question_id, question=question,
                          choices=asked.choices)
        metrics.approval_asked("clarify")
        return asked.question_id, asked.future

    def answer_clarify(self, clarify_id: str, answer: str | None,
                       resolved_by: str = "user", claimed: bool = False) -> None:
        """Resolve a pending clarifying question (``answer`` None: nobody answered): emits
        ``clarify.responded`` ``{clarify_id, resolved_by}`` (the answer itself goes to Hermes,
        which records it; it is not an event). Claimed like :meth:`answer`. Raises Conflict
        ``clarify_not_pending``."""
        with self.run.lock:
            question = self._pending_question(clarify_id, "clarify")
            self._settle(question, answer, resolved_by, claimed,
                         lambda won: won if isinstance(won, str) else None)

    def _pending_question(self, question_id: str, kind: str) -> Question:
        """The pending question ``question_id`` of ``kind`` (under the run's lock); Conflict
        ``<kind>_not_pending`` otherwise."""
        question = self.pending.get(question_id)
        if question is None or question.kind != kind:
            raise not_pending(question_id, kind)
        return question

    def _settle(self, question: Question, value, resolved_by: str, claimed: bool,
                stored: Callable[[Any], Any]) -> None:
        """Resolve ``question`` with ``value`` once across the processes (under the run's lock):
        claimed first unless ``claimed`` already; when another answer won the claim, that one
        (``stored(its value)``: what it may be for this question) resolves it and this one
        is refused as no longer pending."""
        won = None if claimed else self._claim(question.question_id, value, resolved_by)
        if won is not None:
            self._resolve(question, stored(won.get("value")), won.get("resolved_by") or "user")
            raise not_pending(question.question_id, question.kind)
        self._resolve(question, value, resolved_by)

    def _waiting(self) -> None:
        """The status from the pending questions (under the run's lock)."""
        if self.run.status not in ("running", "waiting_for_approval", "waiting_for_answer"):
            return
        kinds = {q.kind for q in self.pending.values()}
        self.run.status = ("waiting_for_approval" if "approval" in kinds else
                       "waiting_for_answer" if kinds else "running")

    def resolve_all(self, resolved_by: str) -> None:
        """Resolve every pending question (an abort): approvals denied, clarifying questions
        unanswered; an ``approval.responded`` / ``clarify.responded`` for each."""
        with self.run.lock:
            pending = [(q.question_id, q.kind) for q in self.pending.values()]
        for question_id, kind in pending:
            try:
                if kind == "approval":
                    self.answer(question_id, "deny", resolved_by)
                else:
                    self.answer_clarify(question_id, None, resolved_by)
            except (Conflict, BadRequest):     # answered meanwhile
                pass

    def end(self) -> None:
        """The run ended (under the run's lock): nobody waits for the pending questions any
        more — each is closed for every process (answers after it: 409) and its waiter
        released (approvals denied, clarifying questions unanswered)."""
        for question in self.pending.values():
            self._claim(question.question_id, None, "end")
            question.future.set_result("deny" if question.kind == "approval" else None)
        self.pending.clear()

"""The client side of the Agent Client Protocol for one ``hermes acp`` process: session updates
to the running prompt's :class:`~.sink.Sink`, Hermes's questions to the run's user
(docs/runners.md §Questions to a human; docs/mnote-client.md §Approvals), and a refusal of
every file or terminal request (the client offers neither capability)."""
from __future__ import annotations

import asyncio
import difflib
import logging
import re
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import BadRequest, Conflict
from .sink import Sink

if TYPE_CHECKING:
    from ..protocol import Questions

log = logging.getLogger("hermes_service.acp")

APPROVAL_MARGIN = 10.0        # Hermes waits this much longer for an answer than we do (s)
APPROVAL_TIMEOUT_ENV = "HERMES_SERVICE_APPROVAL_TIMEOUT"   # read by hermes_site/sitecustomize.py
#: Hermes's permission option id -> the client's choice (Hermes's "deny_always" is a deny there
#: too, and is not offered)
OPTION_CHOICES = {"allow_once": "once", "allow_session": "session", "allow_always": "always",
                  "deny": "deny"}
CHOICE_OPTIONS = {choice: option for option, choice in OPTION_CHOICES.items()}
CLARIFY_METHOD = "hermes_service/clarify"   # the extension request of the clarify callback
CLARIFY_ENV = "HERMES_SERVICE_CLARIFY"      # "1": the import hook installs that callback
CLARIFY_TOOLSET = "clarify"
TOOL_META = "hermesService"   # the _meta key of a tool call's name and preview (toolcalls.py)
#: a tool's name as Hermes registers it (an OpenAI function name: letters, digits, _ and -)
TOOL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")


class Asking(Protocol):
    """The pool's settings the client reads (:class:`~.pool.Pool`)."""
    allow_always: bool          # hermes.approvals.allow_always
    approval_timeout: float     # hermes.approvals.timeout_seconds

    @property
    def own_tool_prefixes(self) -> tuple[str, ...]: ...


class Connected(Protocol):
    """What the client needs of its process (:class:`~.process.AcpProcess`)."""
    inflight: dict[str, Sink]

    @property
    def runner(self) -> Asking: ...


class Client:
    """The client side of the protocol for one process: routes session updates to the
    running prompt's sink; puts permission requests to the run's user when the turn has
    someone to ask, else refuses them (no dangerous command runs without a human; see the
    module doc); refuses file/terminal requests (the client offers neither capability)."""

    def __init__(self, proc: Connected):
        self.proc = proc

    async def session_update(self, session_id, update, **_kw) -> None:
        sink = self.proc.inflight.get(session_id)
        if sink is None:           # history replayed by session/load, or a finished prompt
            return
        sink.touch()
        kind = getattr(update, "session_update", None)
        content = getattr(update, "content", None)
        text = getattr(content, "text", None) if content is not None else None
        listener = sink.listener
        if kind == "agent_message_chunk" and isinstance(text, str):
            sink.message(text)
        elif kind == "agent_thought_chunk" and isinstance(text, str):
            if listener is not None and text:
                listener.reasoning(text)
        elif kind == "tool_call":
            sink.tool_call()
            call_id = update.tool_call_id
            name, preview = tool_identity(update)
            own = (name or "").startswith(self.proc.runner.own_tool_prefixes)
            sink.tools_running[call_id] = None if own else (name, preview)
            if listener is not None and not own:
                listener.tool("tool.started", call_id, name, None, preview)
        elif kind == "tool_call_update" \
                and getattr(update, "status", None) in ("completed", "failed"):
            call_id = update.tool_call_id
            known = call_id in sink.tools_running
            tool = sink.tools_running.pop(call_id, None)
            if listener is not None and known and tool is not None:
                listener.tool("tool.completed", call_id, tool[0], update.status == "completed",
                              tool[1])

    async def request_permission(self, options, session_id, tool_call, **_kw):
        """Hermes asks before a dangerous command or an edit: the user's answer (the turn's
        ``approvals``), or a denial when nobody can be asked or nobody answers in time."""
        from acp.schema import AllowedOutcome, DeniedOutcome, RequestPermissionResponse
        denied = RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        sink = self.proc.inflight.get(session_id)
        asker = sink.approvals if sink is not None else None
        offered = [o.option_id for o in options or []]
        choices = [choice for option, choice in OPTION_CHOICES.items() if option in offered
                   and (choice != "always" or self.proc.runner.allow_always)]
        if sink is None or asker is None or "deny" not in choices or len(choices) < 2:
            log.warning("denied a permission request of Hermes (session %s, tool %s): nobody "
                        "to ask", session_id, getattr(tool_call, "title", "?"))
            return denied
        kind, title, detail = _question(tool_call)
        asked = asker.ask_approval(kind, title, detail, choices)
        if asked is None:                 # the run is ending
            return denied
        approval_id, future = asked

        def deny(questions: Questions = asker) -> str:
            try:
                return questions.answer(approval_id, "deny", "timeout")
            except (Conflict, BadRequest):     # answered at that very moment
                return future.result()
        choice = await self._human(sink, future, deny)
        log.info("permission request of Hermes (session %s, %s) answered %s", session_id, kind,
                 choice)
        if choice not in CHOICE_OPTIONS or choice == "deny":
            return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected",
                                                                    option_id="deny"))
        return RequestPermissionResponse(outcome=AllowedOutcome(
            outcome="selected", option_id=CHOICE_OPTIONS[choice]))

    async def write_text_file(self, *_a, **_kw):
        from acp import RequestError
        raise RequestError.method_not_found("fs/write_text_file")

    async def read_text_file(self, *_a, **_kw):
        from acp import RequestError
        raise RequestError.method_not_found("fs/read_text_file")

    async def ext_method(self, method, params):
        """:data:`CLARIFY_METHOD` ``{sessionId, question, choices}`` → ``{"answer": text or
        None}`` (see the module doc); any other extension request → ``{}``."""
        if method != CLARIFY_METHOD or not isinstance(params, dict):
            return {}
        sink = self.proc.inflight.get(params.get("sessionId") or "")
        asker = sink.approvals if sink is not None else None
        question = params.get("question")
        choices = params.get("choices")
        if sink is None or asker is None or not isinstance(question, str) \
                or not question.strip():
            return {"answer": None, "unavailable": True}
        if not (isinstance(choices, list) and all(isinstance(c, str) for c in choices)):
            choices = None
        asked = asker.ask_clarify(question.strip(), choices)
        if asked is None:
            return {"answer": None, "unavailable": True}
        clarify_id, future = asked

        def unanswered(questions: Questions = asker) -> str | None:
            try:
                questions.answer_clarify(clarify_id, None, "timeout")
            except Conflict:            # answered at that very moment
                pass
            return future.result()
        return {"answer": await self._human(sink, future, unanswered)}

    async def _human(self, sink: Sink, future: Future, give_up: Callable[[], Any]) -> Any:
        """The answer a human gives to one of Hermes's questions (``future``'s result): at
        most ``hermes.approvals.timeout_seconds`` away, then ``give_up()`` resolves it and
        returns the answer that stands. The stall watchdog does not count the wait."""
        sink.asking += 1
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                              self.proc.runner.approval_timeout)
            except TimeoutError:
                return give_up()
        finally:
            sink.asking -= 1
            sink.touch()

    async def ext_notification(self, method, params):
        return None

    def on_connect(self, conn) -> None:
        pass


def tool_identity(update) -> tuple[str | None, str | None]:
    """``(tool_name, preview)`` of a ``tool_call`` update (docs/mnote-client.md §Tool events):
    the tool's own name and the call's redacted detail, from the ``_meta`` the service's
    import hook adds (``hermes_site/toolcalls.py``). A name that is not a tool name
    (:data:`TOOL_NAME`) is None, and so is a preview that is not text. Without the field (a
    Hermes the hook did not reach) the name is the title when it is a bare tool name — Hermes
    titles other tools with their name — else None, and there is no preview (Hermes's title
    of a command is not redacted)."""
    meta = getattr(update, "field_meta", None)
    ours = meta.get(TOOL_META) if isinstance(meta, dict) else None
    if isinstance(ours, dict):
        name, preview = ours.get("toolName"), ours.get("preview")
    else:
        name, preview = getattr(update, "title", None), None
    name = name if isinstance(name, str) and TOOL_NAME.fullmatch(name) else None
    return name, preview if isinstance(preview, str) and preview else None


def _question(tool_call) -> tuple[str, str, str]:
    """``(kind, title, detail)`` of a permission request's tool call: ``command`` (Hermes's
    ``perm-check-*`` calls, kind ``execute``: the description and ``$ command``, which Hermes
    has already redacted), ``edit`` (kind ``edit``: the file and a unified diff), else
    ``other`` (its text content)."""
    acp_kind = getattr(tool_call, "kind", None)
    kind = {"execute": "command", "edit": "edit"}.get(acp_kind or "", "other")
    title = getattr(tool_call, "title", None) or kind
    parts = []
    for item in getattr(tool_call, "content", None) or []:
        block = getattr(item, "content", None)
        text = getattr(block, "text", None)
        if isinstance(text, str):
            parts.append(text)
        elif getattr(item, "type", None) == "diff":
            path = getattr(item, "path", "") or ""
            old = (getattr(item, "old_text", None) or "").splitlines(keepends=True)
            new = (getattr(item, "new_text", None) or "").splitlines(keepends=True)
            parts.append("".join(difflib.unified_diff(old, new, f"a/{path}", f"b/{path}")) or path)
    return kind, title, "\n".join(parts) or title

"""The warm runner: ``hermes acp`` processes spoken to over the Agent Client Protocol
(``hermes.runner: acp``; docs/runners.md; measured facts: docs/hermes-cli-notes.md).

``hermes acp`` (the same pinned ``hermes-agent``, extra ``acp``) is a JSON-RPC agent on
stdio. The service is its client through the protocol's own Python package
(``agent-client-protocol``, pinned to the version Hermes pins). One asyncio loop, on its own
thread, runs every connection; worker threads hand it turns with
:meth:`AcpRunner.run_turn`, which blocks like the CLI runner does.

**Pool.** One process per active user and route family (``v1`` / an extension's: their tool
sets differ), started on the first turn or by :meth:`AcpRunner.prewarm` (the panel creating
a session), with the user's ``HERMES_HOME`` and the same clean environment as CLI runs, in
its own process group recorded with the CLI's (shutdown kills it, a crash's leftovers are
reaped at the next start). Reused while warm; closed after ``hermes.acp.idle_seconds``
idle; at most ``hermes.acp.max_processes`` (the least recently used idle one is closed to
make room; when none is idle the turn runs on the CLI runner); retired after
``hermes.acp.recycle_after_sessions`` sessions or above ``hermes.acp.max_rss_mb`` (Hermes
0.19.0 never frees an ACP session). A retired process takes no new turn and exits once
its running turns end.

**A turn** holds one of the slots CLI turns also use (the global cap, :mod:`.processes`), then:
``session/new`` (a new conversation) or ``session/load`` (an ACP-made session this
process has not loaded; its history replay is discarded), and ``session/prompt`` with the
user's text plus an empty image block — Hermes runs slash commands (``/reset``,
``/model x``) only for prompts made of text blocks alone, so the message always reaches the
model as text. Every ``agent_message_chunk`` becomes a ``message.delta`` as it arrives —
through :class:`~.answer_text.AnswerText`, so that the deltas add up to the recorded answer —
(except a first one that could be the start of Hermes's error text, :data:`ERROR_TEXT_STARTS`,
held until a second one arrives, 0.2 s pass or the turn ends: Hermes 0.19.0 sends provider
errors and its own hints as one ordinary chunk right at the end of a turn, and a turn that
recorded no answer must not show them as answer text), ``agent_thought_chunk`` a
``reasoning.delta``, builtin ``tool_call``/``tool_call_update`` become ``tool.*`` (the tool
calls a family reports itself, ``Family.own_tool_prefix``, do not). The answer is read from Hermes's
record, exactly as for the CLI runner.

**Known 0.19.0 faults, designed around.** A ``session/cancel`` that lands when a session
is idle (or just after a turn) wedges it for good, and one during a tool can raise an
internal error. So an abort of a prompt that has shown answer text (or that shares the
process with another turn) and runs no tool gets ``session/cancel``: measured, Hermes ends a
prompt cancelled mid-stream in 60-310 ms, saves the partial reply itself and the process
stays usable (kept warm when the prompt ends ``cancelled``, else retired); if the prompt has
not ended 1 s later, the process is killed. Every other abort kills the user's process
(SIGTERM, SIGKILL after 1 s). A stopped turn keeps the answer text the client was shown
(docs/runners.md "A stopped turn"): when the kill came first, the service writes it into
the record (:func:`~hermes_service.hermes_state.keep_partial`). An abort before the prompt
(the process starting, ``session/new`` or ``session/load`` pending) ends the turn at once
and leaves the process to finish its start. Timeouts (counted from the turn's start) and
stalls kill the process. After any other failed or aborted turn the process is retired (its
in-memory history may hold the turn Hermes's record took back), and a replacement is started
at once for the next turn — from the settings in force (:attr:`AcpRunner.process_env`), so a
reload reaches it, never from the retired process's environment.

**Questions to a human** (docs/mnote-client.md §Approvals). Hermes 0.19.0's ACP adapter asks before
a dangerous command (and, with edit approval on, before a file edit) with
``session/request_permission``. A turn whose request carries ``approvals`` (client runs with
``hermes.approvals.mode: ask``) puts the question to the run's user (``approvals.ask_approval``:
e.g. an ``approval.request`` event) and answers Hermes with the user's choice — ``once`` /
``session`` / ``always`` / ``deny`` map to Hermes's option ids ``allow_once`` / ``allow_session`` /
``allow_always`` / ``deny``; only the options Hermes offered are choices, ``always`` only with
``hermes.approvals.allow_always`` — or with ``deny`` after ``hermes.approvals.timeout_seconds``
(``resolved_by: timeout``). The wait does not count for the stall watchdog (the hard limit
``hermes.timeout_seconds`` still runs). Every other turn (v1, mode ``deny``) has each request denied
at once, as before. Hermes's own wait for the answer (60 s in ``make_approval_callback``) is
lengthened to ours plus
:data:`APPROVAL_MARGIN` by the service's import hook (``hermes_site/sitecustomize.py``), so
Hermes never gives up first.

**Clarifying questions.** Hermes 0.19.0 offers its ``clarify`` tool no way to reach an ACP
client (the ACP session's agent has no ``clarify_callback``, and ACP has no request for a
question). In the processes of a family whose turns ask their user
(``Family.asks_user``) with ``hermes.approvals.mode: ask`` the
``clarify`` toolset is offered and the import hook gives the tool a callback that asks the
client with the extension request :data:`CLARIFY_METHOD` ``{sessionId, question,
choices}``; :meth:`_Client.ext_method` puts it to the run's user
(``approvals.ask_clarify``: e.g. a ``clarify.request`` event) and answers
``{"answer": <text>}``, or ``{"answer": null}`` after ``hermes.approvals.timeout_seconds``
(Hermes is then told what its CLI tells it: the user did not answer, use your best judgement).

**Fallback to the CLI** (:class:`~hermes_service.runner.UseCli`): a session made by the
CLI (Hermes cannot open it over ACP), a turn for a model other than
``hermes.model.default`` (Hermes's ACP model switch re-detects the provider from the model
name; the user's process is retired when it has that session loaded: its in-memory history
would miss the CLI's turn), a full pool, or a turn accepted before a drain that finds no warm
process for its user (while the service drains the pool starts no process, makes no spare
session and pre-warms nothing; docs/operations.md §Process lifetime). Likewise a process whose copy
of a session is stale (its record changed since the process's last turn there: another service
process on the data dir) is retired before the turn, which then runs on a fresh process.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import hermes_state
from ..config import HermesSettings
from ..errors import BadRequest, Conflict, RunError, ServiceError
from ..hermes_site import run_binding
from ..instance import proc_start
from ..sandbox import kill_strays, limit_signal, tree_cpu_seconds, tree_rss_mb
from .answer_text import AnswerText
from .failures import KILLED, classify_text, failure_reason, limit_error
from .processes import Processes, _stopping, kill_group
from .protocol import LOST_HISTORY_NOTICE, TurnRequest, TurnResult, UseCli, _ctx, answer_from_record

log = logging.getLogger("hermes_service.acp")

#: CPU seconds a warm process's sandbox may use while no turn runs before it is closed
#: (Hermes's own idle work is far below; a process left behind by a turn is not)
IDLE_CPU_SECONDS = 5.0
ABORT_CANCEL_GRACE = 1.0      # seconds an aborted prompt gets to end after session/cancel
FIRST_CHUNK_HOLD = 0.2        # the longest the first message chunk waits for a second one (s)
#: How the text Hermes 0.19.0 sends in place of an answer begins — provider errors and its own
#: hints, one chunk at the end of a turn (``agent/conversation_loop.py`` ``final_response``
#: values, ``acp_adapter/server.py`` ``Error: {e}``; measured: ``HTTP 401: …``, ``API call
#: failed after 1 retries: HTTP 429: …``, ``⚠️ No reply: …``). Only a first chunk that could
#: be the start of one of them is held back (:meth:`_Sink.message`); re-read on a new pin.
ERROR_TEXT_STARTS = (
    "HTTP ", "API call failed", "Error", "⚠", "Billing or credits", "Invalid API response",
    "I apologize, but I encountered", "Request payload too large", "Context length exceeded",
    "Response truncated", "First response truncated", "Operation interrupted",
    "Model generated invalid tool call", "Incomplete REASONING_SCRATCHPAD",
    "Codex response remained", "(empty)", "Failed", "No ", "Connection", "Provider",
    "Rate limit", "Authentication", "Unauthorized", "Request timed out", "Timeout",
)


def could_be_error_text(text: str) -> bool:
    """Could a first message chunk be (the start of) Hermes's error text instead of an answer
    (:data:`ERROR_TEXT_STARTS`)? A chunk shorter than a prefix counts when it starts one."""
    head = text.lstrip()
    if not head:
        return True
    return any(head.startswith(p) or p.startswith(head) for p in ERROR_TEXT_STARTS)
POLL_SECONDS = 0.05
REPLACE_TRIES = 3             # attempts at a replacement process that reloads keep outdating
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
STDERR_TAIL_BYTES = 16384
#: The largest JSON-RPC message read from a Hermes process (bytes, one line). A longer one
#: ends the connection: the process is retired and its turn fails ``hermes_failed``
#: (docs/mnote-client.md §Sizes of events). Hermes's own largest messages — a replayed tool result
#of a : session/load — stay far below it.
ACP_MESSAGE_BYTES = 8 * 1024 * 1024


@dataclass
class _Sink:
    """Where one running prompt's updates go."""
    listener: object | None
    last_activity: float = field(default_factory=time.monotonic)
    held: str | None = None          # the first message chunk, until a second one arrives
    delivered: int = 0               # deltas handed to the listener
    answer: AnswerText = field(default_factory=AnswerText)   # the deltas, adding up to the answer
    text: list[str] = field(default_factory=list)   # every message chunk (failure reasons)
    tools_running: dict[str, tuple | None] = field(default_factory=dict)  # call id -> (name,
    #                    preview), or None for a tool its family reports (own_tool_prefix)
    kill_reason: str | None = None
    ended: bool = False              # the prompt has answered: the runner decides what is shown
    approvals: object = None         # who answers Hermes's questions (TurnRequest.approvals)
    asking: int = 0                  # questions waiting for a human now (no stall meanwhile)
    _timer: object = None

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def message(self, text: str) -> None:
        self.text.append(text)
        if not self.delivered and self.held is None and could_be_error_text(text):
            self.held = text
            # a turn's error text comes alone, right before the prompt's answer; a real
            # first piece is followed by more, or the turn keeps going past the hold
            self._timer = asyncio.get_running_loop().call_later(FIRST_CHUNK_HOLD, self._hold_over)
            return
        self.release()
        self._deliver(text)

    def _hold_over(self) -> None:
        if not self.ended:
            self.release()

    def release(self) -> None:
        """Hand the held first chunk over (a second chunk arrived, the hold is over, or the
        turn answered)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.held is not None:
            held, self.held = self.held, None
            self._deliver(held)

    @property
    def shown(self) -> str:
        """The answer text handed to the listener (kept when the turn is stopped)."""
        return self.answer.text

    def tool_call(self) -> None:
        """The model called a tool: what it wrote before is one piece of the answer."""
        self.release()
        self.answer.tool_call()

    def _deliver(self, text: str) -> None:
        if self.listener is not None:
            self._send(self.answer.feed(text))

    def complete(self, answer: str) -> None:
        """The turn answered ``answer`` (its record): send what the deltas lack of it."""
        if self.listener is not None and self.delivered:
            self._send(self.answer.rest(answer))

    def close_tools(self) -> None:
        """The prompt is over: a call Hermes never reported ended gets its ``tool.completed``
        now, ``ok`` unknown (None), so that every reported start has an end."""
        running, self.tools_running = self.tools_running, {}
        for call_id, tool in running.items():
            if tool is not None and self.listener is not None:
                self.listener.tool("tool.completed", call_id, tool[0], None, tool[1])

    def _send(self, delta: str) -> None:
        if delta:
            self.delivered += 1
            self.listener.delta(delta)


class _Handle:
    """What a turn's listener gets from :meth:`TurnListener.started` on the ACP runner:
    ``touch()`` feeds the stall watchdog, ``kill(reason)`` asks the turn to end."""

    def __init__(self, sink: _Sink):
        self._sink = sink

    def touch(self) -> None:
        self._sink.touch()

    def kill(self, reason: str) -> None:
        self._sink.kill_reason = self._sink.kill_reason or reason


class _Client:
    """The client side of the protocol for one process: routes session updates to the
    running prompt's sink; puts permission requests to the run's user when the turn has
    someone to ask, else refuses them (no dangerous command runs without a human; see the
    module doc); refuses file/terminal requests (the client offers neither capability)."""

    def __init__(self, proc: AcpProcess):
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
        runner = self.proc.runner
        choices = [choice for option, choice in OPTION_CHOICES.items() if option in offered
                   and (choice != "always" or runner.allow_always)]
        if asker is None or "deny" not in choices or len(choices) < 2:
            log.warning("denied a permission request of Hermes (session %s, tool %s): nobody "
                        "to ask", session_id, getattr(tool_call, "title", "?"))
            return denied
        kind, title, detail = _question(tool_call)
        asked = asker.ask_approval(kind, title, detail, choices)
        if asked is None:                 # the run is ending
            return denied
        approval_id, future = asked
        sink.asking += 1
        try:
            try:
                choice = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                                runner.approval_timeout)
            except TimeoutError:
                try:
                    choice = asker.answer(approval_id, "deny", "timeout")
                except (Conflict, BadRequest):     # answered at that very moment
                    choice = future.result()
        finally:
            sink.asking -= 1
            sink.touch()
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
        sink = self.proc.inflight.get(params.get("sessionId"))
        asker = sink.approvals if sink is not None else None
        question = params.get("question")
        choices = params.get("choices")
        if asker is None or not isinstance(question, str) or not question.strip():
            return {"answer": None, "unavailable": True}
        if not (isinstance(choices, list) and all(isinstance(c, str) for c in choices)):
            choices = None
        asked = asker.ask_clarify(question.strip(), choices)
        if asked is None:
            return {"answer": None, "unavailable": True}
        clarify_id, future = asked
        sink.asking += 1
        try:
            try:
                answer = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                                self.proc.runner.approval_timeout)
            except TimeoutError:
                try:
                    asker.answer_clarify(clarify_id, None, "timeout")
                except Conflict:            # answered at that very moment
                    pass
                answer = future.result()
        finally:
            sink.asking -= 1
            sink.touch()
        return {"answer": answer}

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
    import difflib
    acp_kind = getattr(tool_call, "kind", None)
    kind = {"execute": "command", "edit": "edit"}.get(acp_kind, "other")
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


class AcpProcess:
    """One ``hermes acp`` process: its connection, the sessions it has loaded, its running
    prompts. Lives on the runner's loop; :meth:`kill` may be called from any thread."""

    def __init__(self, runner: AcpRunner, key: tuple[str, str], home, env: dict,
                 extra_toolsets: list[str] | None = None):
        self.runner, self.key, self.home, self.env = runner, key, home, env
        #: the toolsets it was started with beyond ``hermes.toolsets`` (its family's)
        self.extra_toolsets = list(extra_toolsets or [])
        self.proc: asyncio.subprocess.Process | None = None
        self.pgid: int | None = None
        self.conn = None
        self.ready: asyncio.Future | None = None
        self.sessions: set[str] = set()
        self.loading: dict[str, asyncio.Future] = {}  # session/load in flight, by session
        self.seen: dict[str, tuple | None] = {}   # session -> its record after our last turn
        self.record_file: tuple | None = None   # its state.db (device, inode) after that turn
        self.inflight: dict[str, _Sink] = {}
        self.reserved = 0        # turns that acquired this process and have not ended yet
        self.sessions_opened = 0
        # a session/new made ahead for the next conversation
        self.spare: asyncio.Task | None = None
        self.last_used = time.monotonic()
        self.retired = False
        self.dead = False
        self.kill_reason: str | None = None
        self.stderr_tail = bytearray()
        self.launch = None
        self.limit: str | None = None     # the sandbox limit that ended it (sandbox.py)
        self.idle_cpu: float | None = None  # its sandbox's CPU seconds when its last turn ended
        sandbox = runner.processes.sandbox
        self.cwd = sandbox.home_path(home) if sandbox else str(home.root)

    # -- life ------------------------------------------------------------------------
    async def start(self) -> None:
        import acp
        from acp.schema import ClientCapabilities, Implementation
        self.launch = self.runner.processes.launch(["acp"], self.env, self.home)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.launch.argv, env=self.launch.env, cwd=self.launch.cwd,
                pass_fds=self.launch.pass_fds, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, limit=ACP_MESSAGE_BYTES)
        except OSError:
            self.launch.close()
            raise
        self.launch.pid = self.proc.pid
        self.launch.started()
        self.pgid = self.proc.pid
        self.runner.processes.groups.add(self, self.env.get("HERMES_HOME"))
        loop = asyncio.get_running_loop()
        # the loop keeps only weak references to tasks: hold ours until the process ends
        self._readers = (loop.create_task(self._drain_stderr()),
                         loop.create_task(self._watch_exit()))
        self.conn = acp.connect_to_agent(_Client(self), self.proc.stdin, self.proc.stdout)
        await asyncio.wait_for(self.conn.initialize(
            protocol_version=acp.PROTOCOL_VERSION, client_capabilities=ClientCapabilities(),
            client_info=Implementation(name="hermes-service", version="1")),
            self.runner.start_timeout)
        log.info("ACP process started user=%s family=%s pid=%s", self.key[0], self.key[1],
                 self.pgid)

    async def _drain_stderr(self) -> None:
        while True:
            chunk = await self.proc.stderr.read(65536)
            if not chunk:
                return
            self.stderr_tail += chunk
            del self.stderr_tail[:-STDERR_TAIL_BYTES]

    async def _watch_exit(self) -> None:
        rc = await self.proc.wait()
        self.limit = self.limit or self.launch.limit_hit() or limit_signal(rc)
        self.launch.close()
        self.dead = True
        self.runner.processes.groups.forget(self)
        self.runner._gone(self)
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

    async def new_session(self) -> str:
        """An ACP session for a new conversation: the spare one made ahead when there is one
        (``session/new`` takes 1.5–3 s in Hermes 0.19.0), else a new one."""
        spare, self.spare = self.spare, None
        if spare is not None:
            try:
                return await spare
            except Exception:  # noqa: BLE001 - the spare failed: make one now
                pass
        sid = (await self.conn.new_session(cwd=self.cwd)).session_id
        self.sessions.add(sid)
        self.sessions_opened += 1
        return sid

    def make_spare(self) -> None:
        """Make the next conversation's session ahead, while the process is idle."""
        if self.spare is None and not self.inflight and not self.retired and not self.dead \
                and not self.runner.processes.draining:
            async def make():
                sid = (await self.conn.new_session(cwd=self.cwd)).session_id
                self.sessions.add(sid)
                self.sessions_opened += 1
                return sid
            self.spare = asyncio.get_running_loop().create_task(make())
            self.spare.add_done_callback(lambda t: t.cancelled() or t.exception())

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


def _record_file(home) -> tuple | None:
    """``(device, inode)`` of the home's ``state.db`` (not followed), None when missing."""
    try:
        st = os.lstat(home.hermes_home / "state.db")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _ended(reason: str) -> RunError:
    """The error of a turn ended early for ``reason`` (a key of ``KILLED``)."""
    status, code, detail = KILLED[reason]
    return RunError(detail, code=code, status=status)


class AcpRunner:
    """The ACP runner (see the module doc). Starts its processes through ``processes``
    (:class:`~hermes_service.runner.processes.Processes`), which it shares with the CLI
    runner: the command, the slots, the process groups, the run files, the time limits and
    toolsets."""
    name = "acp"

    def __init__(self, hermes: HermesSettings, processes: Processes,
                 process_env: Callable[[str], tuple] | None = None):
        """``process_env(user_id)`` → ``(home, env)``: the user's home brought up to date and
        the environment of a new Hermes process, from the settings in force (the
        composition root gives :class:`~hermes_service.user_homes.UserHomes`'); a
        replacement process (:meth:`_replace`) is built from it. None: no replacement is
        started ahead; the user's next turn starts one with its own environment."""
        self.processes = processes
        self.process_env = process_env
        self._procs: dict[tuple[str, str], AcpProcess] = {}     # accepting new turns
        self._retired: set[AcpProcess] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._generation = 0      # counts the reloads that retired every process
        self.configure(hermes, retire=False)

    @property
    def own_tool_prefixes(self) -> tuple[str, ...]:
        """Tool-name prefixes of the calls the route families report themselves."""
        return tuple(f.own_tool_prefix for f in self.processes.families.values()
                     if f.own_tool_prefix)

    def configure(self, hermes: HermesSettings, retire: bool = True) -> None:
        """Take a (reloaded) ``hermes`` section: ``hermes.acp``, ``hermes.approvals`` and the
        default model (docs/configuring.md §Reload). ``retire``: the section or the users' template
        changed, and warm processes run with the old environment, toolsets, model and
        template: every one is retired (it ends its running turns; the next turn starts a
        new process)."""
        acp = hermes.acp
        self.idle_seconds = float(acp.idle_seconds)
        self.max_processes = int(acp.max_processes)
        self.recycle_after = int(acp.recycle_after_sessions)
        self.max_rss_mb = float(acp.max_rss_mb)
        self.start_timeout = float(acp.start_timeout_seconds)
        approvals = hermes.approvals
        self.approval_timeout = float(approvals.timeout_seconds)
        self.allow_always = bool(approvals.allow_always)
        self.ask = approvals.mode == "ask"
        self.default_model = hermes.model.default
        if retire:
            self._generation += 1
        if retire and self._loop is not None:
            async def retire_all():
                for proc in list(self._procs.values()):
                    self._retire(proc, "the configuration was reloaded")
            self._call(retire_all()).result(10)

    # -- the loop --------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="acp-loop",
                                 daemon=True).start()
                asyncio.run_coroutine_threadsafe(self._sweeper(), self._loop)
            return self._loop

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def process_count(self) -> int:
        """ACP processes alive now (accepting or retiring)."""
        return len(self._procs) + len(self._retired)

    # -- public ----------------------------------------------------------------------
    def prewarm(self, home, env: dict, family: str, toolsets: list[str]) -> None:
        """Start the user's process for ``family`` in the background (no wait, no error);
        nothing while the service drains (docs/operations.md §Process lifetime).
        ``toolsets``: the family's, offered beside ``hermes.toolsets``."""
        if self.processes.draining or self.processes.stopping:
            return
        if self.process_count() >= self.max_processes and not self._idle():
            return
        fut = self._call(self._acquire((home.user_id, family), home, env, toolsets))
        fut.add_done_callback(lambda f: not f.cancelled() and f.exception()
                              and log.info("ACP pre-warm failed: %s", f.exception()))

    def run_turn(self, req: TurnRequest) -> TurnResult:
        """Run one turn on the user's ACP process (holding a slot). Raises
        :class:`UseCli` when this runner cannot serve it, else like the CLI runner."""
        source, now = hermes_state.session_state(req.home.hermes_home, req.resume_id)
        if req.model and req.model != self.default_model:
            if source == "acp":       # the CLI turn adds to the record, not to a warm process
                self._call(self._forget(req)).result(5)
            raise UseCli(f"model {req.model} is not hermes.model.default")
        if req.resume_id and source not in (None, "acp"):
            raise UseCli(f"the Hermes session was made by the {source} runner")
        self.processes.check_home_quota(req.home)
        with self.processes.slot(req.cancel) as waited:
            started = time.monotonic()
            sink = _Sink(req.listener, approvals=req.approvals)
            if source != "acp":
                now = None
            lost = req.resume_id is not None and source is None
            fut = self._call(self._turn(req, sink, lost=lost, record=now))
            try:
                sid, response, resumed, proc = fut.result()
                sink.close_tools()
            except (ServiceError, UseCli) as err:
                sink.close_tools()
                if self.processes.stopping and isinstance(err, ServiceError) \
                        and err.code not in ("run_cancelled", "service_stopping"):
                    raise _stopping() from None  # the shutdown killed the process it needed
                if getattr(err, "code", "") == "run_cancelled" and sink.shown:
                    self._keep_shown(req, getattr(err, "hermes_session_id", None), sink)
                if getattr(err, "code", "") not in ("run_cancelled", "service_stopping", None):
                    log.warning("hermes acp turn failed %s code=%s", _ctx(req.log_ctx), err.code)
                raise
            except Exception as exc:  # noqa: BLE001 - the protocol failed (process died, ...)
                sink.close_tools()
                if self.processes.stopping:    # the shutdown killed the process and ended the loop
                    raise _stopping() from None
                log.warning("hermes acp turn failed %s: %r", _ctx(req.log_ctx), exc)
                self._call(self._retire_key((req.home.user_id, req.family))).result(5)
                raise RunError("the Hermes agent failed", code="hermes_failed") from None
        notice = LOST_HISTORY_NOTICE if req.resume_id and source is None else None
        try:
            answer = answer_from_record(req, sid, limits=self.processes.sandboxed)
            proc.seen[sid] = hermes_state.fingerprint(req.home.hermes_home, sid)
            proc.record_file = _record_file(req.home)
        except RunError as failed:
            err = failed
            record = hermes_state.turn_record(req.home.hermes_home, sid, req.message)
            if record.assistant_rows == 0 and not record.empty_sentinel and sink.text:
                err = classify_text("".join(sink.text))   # a provider error, sent as text
                log.warning("hermes acp turn failed %s code=%s reason=%s", _ctx(req.log_ctx),
                            err.code, failure_reason("".join(sink.text)))
            err.hermes_session_id = sid
            # its in-memory history may hold the turn the record takes back: no further turn there
            self._call(self._retire_key((req.home.user_id, req.family))).result(5)
            raise err from None
        sink.release()
        sink.complete(answer.text)
        usage = None
        if response is not None and getattr(response, "usage", None) is not None:
            u = response.usage
            usage = {"input_tokens": u.input_tokens or 0, "output_tokens": u.output_tokens or 0,
                     "total_tokens": u.total_tokens or 0}
        return TurnResult(answer.text, sid, time.monotonic() - started, runner=self.name,
                          reasoning=answer.reasoning, resumed=resumed, notice=notice,
                          streamed=sink.delivered > 0, usage=usage, queue_wait=waited,
                          finish_reason=answer.finish_reason)

    def _keep_shown(self, req: TurnRequest, sid: str | None, sink: _Sink) -> None:
        """A stopped turn keeps the answer text the client was shown (docs/runners.md "A
        stopped turn"): Hermes saved it when ``session/cancel`` ended the prompt, else (the
        process was killed) it is written to the record now."""
        try:
            if hermes_state.keep_partial(req.home.hermes_home, sid, req.message, sink.shown):
                log.info("kept the partial answer of a stopped turn %s", _ctx(req.log_ctx))
        except (ServiceError, sqlite3.Error) as exc:   # the abort stands: a
            # tampered home (409), or a state.db another process keeps locked past its timeout
            log.warning("could not keep the partial answer of a stopped turn %s: %s",
                        _ctx(req.log_ctx), exc)

    def close(self, timeout: float = 2.0) -> None:
        """Kill every process and stop the loop (the service stops)."""
        for proc in list(self._procs.values()) + list(self._retired):
            proc.kill("shutdown")
            self.processes.groups.forget(proc)
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout)
        except Exception:     # noqa: BLE001 - best effort at exit
            pass
        loop.call_soon_threadsafe(loop.stop)

    # -- pool (loop thread) ------------------------------------------------------------
    def _idle(self) -> list[AcpProcess]:
        procs = list(self._procs.values()) + list(self._retired)
        return sorted((p for p in procs if not p.busy and not p.dead
                       and p.ready is not None and p.ready.done()),   # not while it starts
                      key=lambda p: p.last_used)

    async def _acquire(self, key, home, env: dict, toolsets: list[str],
                       reserve: bool = False) -> AcpProcess:
        """The user's process for ``key``, started if needed (``toolsets``: the family's,
        beside ``hermes.toolsets``). ``reserve``: for a turn, which must release it
        (``proc.reserved -= 1``); a reserved process is never idle."""
        while True:       # every await below may change the pool: look again after it
            proc = self._procs.get(key)
            if proc is not None and not proc.dead:
                ok = await asyncio.shield(proc.ready)
                if ok and not proc.dead and not proc.retired:
                    proc.last_used = time.monotonic()
                    proc.reserved += reserve
                    return proc
                continue
            if self.processes.draining:     # the service is stopping: no new process (
                raise UseCli("the service is draining")   # docs/operations.md §Process lifetime)
            if self.process_count() >= self.max_processes:
                idle = self._idle()
                if not idle:
                    raise UseCli("the ACP process pool is full")
                await self._close(idle[0], "evicted")
                continue
            proc = await self._start(key, home, env, toolsets)
            if proc.retired:      # retired while it started (a reload): start a fresh one
                asyncio.get_running_loop().create_task(self._close(proc, "retired"))
                continue
            proc.reserved += reserve
            return proc

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
        proc.ready = asyncio.get_running_loop().create_future()
        self._procs[key] = proc
        try:
            await proc.start()
            if proc.ready.done() or proc.dead:      # closed while it started
                raise RuntimeError("the process was closed while it started")
        except Exception as exc:  # noqa: BLE001 - any failure to start: the waiters get it
            if self._procs.get(key) is proc:
                del self._procs[key]
            if not proc.ready.done():
                proc.ready.set_exception(exc)
                proc.ready.exception()      # retrieved: no "never retrieved" warning
            proc.kill("start failed")
            log.warning("ACP process for user=%s could not start: %s %s", key[0], exc,
                        failure_reason(proc.stderr_tail.decode("utf-8", "replace")[-2000:]))
            raise RunError("the Hermes ACP process could not be started (see the service log)",
                           code="hermes_failed") from None
        proc.ready.set_result(True)
        if not proc.retired:
            proc.make_spare()
        return proc

    def _gone(self, proc: AcpProcess) -> None:
        if self._procs.get(proc.key) is proc:
            del self._procs[proc.key]
        self._retired.discard(proc)
        if proc.ready is not None and not proc.ready.done():
            proc.ready.set_result(False)

    async def _close(self, proc: AcpProcess, why: str) -> None:
        log.info("closing ACP process of user=%s (%s)", proc.key[0], why)
        proc.retired = True
        self._gone(proc)
        await proc.kill_async(why)

    def _retire(self, proc: AcpProcess, why: str) -> None:
        """No new turn for ``proc``; it exits once its running turns end."""
        if proc.dead or proc.retired:
            return
        log.info("retiring ACP process of user=%s (%s)", proc.key[0], why)
        proc.retired = True
        if self._procs.get(proc.key) is proc:
            del self._procs[proc.key]
        self._retired.add(proc)
        if not proc.busy and (proc.ready is None or proc.ready.done()):
            asyncio.get_running_loop().create_task(self._close(proc, why))

    async def _retire_key(self, key) -> None:
        proc = self._procs.get(key)
        if proc is not None:
            self._retire(proc, "a turn failed")
            self._replace(proc)

    async def _forget(self, req: TurnRequest) -> None:
        """A turn of an ACP session runs on the CLI (another model): the user's warm process
        keeps that conversation in memory and would answer its next turn without the CLI's
        turn (Hermes reads a loaded session's history from state.db only once), so it takes
        no further turn; a replacement loads the session afresh."""
        proc = self._procs.get((req.home.user_id, req.family))
        if proc is not None and req.resume_id in proc.sessions:
            self._retire(proc, "a CLI turn continues one of its sessions")
            self._replace(proc)

    def _replace(self, old: AcpProcess) -> None:
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
        for _ in range(REPLACE_TRIES):
            generation = self._generation
            home, env = await loop.run_in_executor(None, self.process_env, key[0])
            if generation != self._generation or self.processes.draining:
                continue
            proc = await self._acquire(key, home, env, extra)
            if generation == self._generation:
                return
            self._retire(proc, "the configuration was reloaded while it started")

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(min(10.0, max(1.0, self.idle_seconds / 4)))
            now = time.monotonic()
            for proc in list(self._procs.values()) + list(self._retired):
                if proc.dead or proc.busy or proc.ready is None or not proc.ready.done():
                    continue          # in use, or still starting
                if proc.retired:
                    await self._close(proc, "retired")
                elif now - proc.last_used >= self.idle_seconds:
                    await self._close(proc, "idle")
                elif proc.idle_cpu is not None and \
                        proc.launch.cpu_seconds() - proc.idle_cpu > IDLE_CPU_SECONDS:
                    await self._close(proc, "it used CPU between turns")

    # -- one turn (loop thread) --------------------------------------------------------
    async def _turn(self, req: TurnRequest, sink: _Sink, lost: bool, record: tuple | None = None):
        """Returns (ACP session id, PromptResponse, resumed, process). Raises RunError/UseCli.
        ``record``: the session's :func:`~hermes_service.hermes_state.fingerprint` now."""
        key = (req.home.user_id, req.family)
        deadline = time.monotonic() + self.processes.timeout
        while True:
            acquiring = asyncio.ensure_future(self._acquire(
                key, req.home, req.env, req.toolsets, reserve=True))
            reason = await self._wait_open(acquiring, req, deadline)
            if reason is not None:
                # an abort or the time limit while the process starts: the start goes on (the
                # user's next turn finds it warm); the turn ends now, its reservation given back
                acquiring.add_done_callback(self._unreserve)
                raise _ended(reason)
            proc = acquiring.result()
            sid = req.resume_id
            if proc.record_file not in (None, _record_file(req.home)):
                # its state.db was replaced (the service removed what the agent planted
                # there): the process still writes to the old one, whose turns nobody reads
                self._retire(proc, "its state.db was replaced")
                self._release(proc)
                continue
            if lost or sid not in proc.seen or proc.seen[sid] == record:
                break
            # the record changed since this process's last turn there (another service
            # process on the data dir, a CLI turn): its in-memory history is stale, and
            # Hermes reads a loaded session only once. A fresh process loads it again.
            self._retire(proc, "another process continued one of its sessions")
            self._release(proc)
        try:
            return (*await self._turn_in(proc, req, sink, lost, deadline), proc)
        finally:
            self._release(proc)

    def _release(self, proc: AcpProcess) -> None:
        proc.reserved -= 1
        if not proc.busy and not proc.dead and proc.launch is not None and proc.launch.sandboxed:
            # nothing a turn started outlives it (a daemonized tool command would burn CPU
            # or hold files between turns, outside every turn's limits)
            strays = kill_strays(proc.pgid)
            if strays:
                log.warning("ended %d process(es) a turn of user=%s left in its sandbox",
                            strays, proc.key[0])
            proc.idle_cpu = proc.launch.cpu_seconds()
        if proc.retired and not proc.busy and not proc.dead:
            asyncio.get_running_loop().create_task(self._close(proc, "retired"))

    def _unreserve(self, task) -> None:
        if not task.cancelled() and task.exception() is None:
            self._release(task.result())

    async def _wait_open(self, task, req: TurnRequest, deadline: float) -> str | None:
        """Wait for a step before the prompt (the process, ``session/new``, ``session/load``);
        the reason to give up on it (an abort, the time limit), or None when it is done."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done:
                return None
            if req.cancel is not None and req.cancel.is_set():
                return "cancelled"
            if time.monotonic() >= deadline:
                return "timeout"

    async def _turn_in(self, proc: AcpProcess, req: TurnRequest, sink: _Sink, lost: bool,
                       deadline: float):
        from acp import text_block
        from acp.schema import ImageContentBlock
        key = proc.key
        sid = None if lost else req.resume_id
        resumed = sid is not None
        opening = None
        if sid is None:
            opening = asyncio.ensure_future(proc.new_session())
        elif sid not in proc.sessions:
            # one session/load per session: a turn aborted while it loads leaves it running,
            # and the next turn there waits for it instead of loading the session twice
            opening = proc.loading.get(sid)
            if opening is None:
                async def load(sid=sid):
                    try:
                        # (Hermes restores it on the config's model and endpoint, never the
                        # ones its state.db row names: hermes_site/sitecustomize.py)
                        await proc.conn.load_session(cwd=proc.cwd, session_id=sid)
                        proc.sessions.add(sid)
                        proc.sessions_opened += 1
                        return sid
                    finally:
                        proc.loading.pop(sid, None)
                opening = proc.loading[sid] = asyncio.ensure_future(load())
        if opening is not None:
            reason = await self._wait_open(opening, req, deadline)
            if reason is not None:
                opening.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved
                if reason != "cancelled":       # Hermes does not answer: end the process
                    proc.retired = True
                    self._gone(proc)
                    await proc.kill_async(reason)
                    self._replace(proc)
                raise _ended(reason)
            sid = opening.result()
        # the run binding rides in the prompt's _meta, into Hermes's memory only
        meta = {run_binding.META: req.plugin_run} if req.plugin_run is not None else {}
        proc.inflight[sid] = sink
        if proc.launch is not None and len(proc.inflight) == 1:
            proc.launch.mark()        # this turn's CPU budget (hermes.sandbox.limits.cpu_seconds)
        if req.listener is not None:
            req.listener.started(_Handle(sink))
        # the empty image block keeps Hermes from running the text as a slash command
        blocks = [text_block(req.message),
                  ImageContentBlock(type="image", data="", mime_type="image/png")]
        prompt = proc.conn.prompt(prompt=blocks,
                                  session_id=sid, **meta)
        task = asyncio.get_running_loop().create_task(prompt)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved
        try:
            reason = await self._watch(task, proc, sink, req, deadline)
            if reason is not None:
                await self._end(task, proc, sid, sink, reason)
                if reason == "limit":
                    err = limit_error(proc.limit)
                else:
                    status, code, detail = KILLED.get(reason, (
                        502, "hermes_failed", "the user's Hermes process ended; retry"))
                    err = RunError(detail, code=code, status=status)
                err.hermes_session_id = sid
                raise err
            sink.ended = True
            try:
                response = task.result()
            except Exception as exc:  # noqa: BLE001 - any protocol failure: hermes_failed
                self._retire(proc, "a prompt failed")
                self._replace(proc)
                err = RunError("the Hermes agent failed", code="hermes_failed")
                err.hermes_session_id = sid
                log.warning("ACP prompt failed user=%s: %r", key[0], exc)
                raise err from None
        finally:
            proc.inflight.pop(sid, None)
            proc.last_used = time.monotonic()
        cpu_cap = self.processes.sandbox.settings.limits.cpu_seconds / 2 \
            if self.processes.sandboxed else None
        if proc.sessions_opened >= self.recycle_after or proc.rss_mb() > self.max_rss_mb \
                or (cpu_cap is not None and proc.launch.cpu_seconds() > cpu_cap):
            self._retire(proc, f"{proc.sessions_opened} sessions, {proc.rss_mb():.0f} MB, "
                               f"{proc.cpu_seconds():.0f} s CPU")
            self._replace(proc)
        else:
            asyncio.get_running_loop().call_later(0.5, proc.make_spare)
        return sid, response, resumed

    async def _watch(self, task, proc: AcpProcess, sink: _Sink, req: TurnRequest,
                     deadline: float) -> str | None:
        """Wait for the prompt; the reason to end it early, or None when it finished."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done and not (proc.dead and not task.cancelled() and task.exception() is not None):
                return None
            if proc.limit is None and proc.launch is not None:
                proc.limit = proc.launch.limit_hit()
                if proc.limit is not None:
                    proc.kill_reason = "limit"
                    return "limit"
            if proc.dead:
                if proc.limit is not None:
                    return "limit"
                return proc.kill_reason if proc.kill_reason in KILLED else "died"
            if sink.kill_reason or (req.cancel is not None and req.cancel.is_set()):
                return sink.kill_reason if sink.kill_reason in KILLED else "cancelled"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if sink.asking:              # a human is being asked: not a stall
                sink.last_activity = now
            if now - sink.last_activity >= self.processes.stall_timeout:
                return "stall"

    async def _end(self, task, proc: AcpProcess, sid: str, sink: _Sink, reason: str) -> None:
        """End a prompt early without leaving a wedged session (see the module doc).

        An abort of a prompt that has shown answer text (or that shares the process with
        another turn) and runs no tool gets ``session/cancel`` first: Hermes then saves the
        partial reply itself (measured: ``stopReason: cancelled`` 60-310 ms later). A prompt
        Hermes ended as ``cancelled`` leaves the process warm (its record and memory agree;
        :attr:`AcpProcess.seen` is brought up to date); any other end retires it. A prompt
        that has not ended after :data:`ABORT_CANCEL_GRACE` is killed like every other
        early end (the caller then keeps the shown text: :func:`hermes_state.keep_partial`)."""
        others = [s for s in proc.inflight if s != sid]
        if reason == "cancelled" and (others or sink.delivered) and not sink.tools_running \
                and not proc.dead:
            try:
                await proc.conn.cancel(session_id=sid)
                done, _ = await asyncio.wait({task}, timeout=ABORT_CANCEL_GRACE)
            except Exception as exc:       # noqa: BLE001 - the kill below ends it anyway
                log.info("session/cancel failed user=%s: %r", proc.key[0], exc)
                done = ()
            if done:
                stop = None if task.cancelled() or task.exception() is not None \
                    else getattr(task.result(), "stop_reason", None)
                if stop == "cancelled" and not proc.dead:
                    proc.seen[sid] = await asyncio.get_running_loop().run_in_executor(
                        None, hermes_state.fingerprint, proc.home.hermes_home, sid)
                else:
                    self._retire(proc, "a turn was aborted")
                    self._replace(proc)
                return
        if not proc.dead:
            proc.retired = True
            self._gone(proc)
            await proc.kill_async(reason)
            if reason != "shutdown":
                self._replace(proc)
        task.cancel()


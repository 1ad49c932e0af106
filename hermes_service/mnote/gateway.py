"""Run-scoped tool tokens and the path of one mnote tool call (tool contract §1-§5).

1. When a run starts, :meth:`ToolGateway.run_binding` mints a random token bound
   to the actor, workspace, document, session, run, trace and the run's
   capability scope, and returns the run binding the runner hands to the run's
   Hermes process for the mnote plugin (``toolUrl``, ``runToken``, the ids,
   ``capabilityScope``): into that process's memory only, never a file another run's
   tools could read (docs/mnote-tools.md §Run binding). Only a SHA-256 of the token
   is kept; it is revoked when the run ends (:meth:`end_run`).
2. The ``mnote`` Hermes plugin (users_template/plugins/mnote) builds the
   contract's input envelope and POSTs it with ``Authorization: Bearer <token>``.
3. :meth:`ToolGateway.invoke` refuses an unknown/revoked token, an envelope
   whose actor/session/run differ from the token's; a call outside the run's
   workspace, or a write to another page than the run's, gets
   ``mnote_tool_permission_denied`` (nothing leaked); it forces the token's
   trace and capability scope into the envelope, emits ``tool.started`` /
   ``tool.completed`` (and, for a stored suggestion, ``suggestion.created``:
   :func:`suggestion_created`) on the run's event stream (:func:`tool_identity`), marks
   tool activity for the stall watchdog, and hands the envelope to the
   :class:`~hermes_service.mnote.tools.ToolExecutor` (schemas, scope; then the embedded
   store's permissions, idempotency, dryRun and audit, or mnote's kernel's:
   ``mnote.page_store.kind``, docs/mnote-tools.md §The kernel adapter). Hermes never writes
   the store directly.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass

from ..errors import is_id
from .page_sqlite import SQLitePageStore
from .tools import TOOLS_BY_NAME, Backend, ToolExecutor

TOKEN_BYTES = 32


@dataclass(frozen=True)
class RunClaims:
    """What a run token stands for."""
    actor_id: str
    workspace_id: str
    document_id: str
    session_id: str
    run_id: str
    trace_id: str
    capability_scope: tuple[str, ...]


class ToolRefused(Exception):
    """The caller may not call tools: ``status`` 401 (token) or 403 (envelope not the token's)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class ToolGateway:
    """Token registry + tool invocation for the runs of one service process."""

    def __init__(self, store: SQLitePageStore | None, service_url: str | None = None, *,
                 backend: Backend | None = None):
        """``store``: the embedded page store, or None with ``backend`` (mnote's kernel)."""
        self.store = store
        self.executor = ToolExecutor(store) if backend is None else ToolExecutor(backend=backend)
        self.service_url = service_url
        self._tokens: dict[str, tuple[RunClaims, object]] = {}
        self._by_run: dict[str, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()

    def run_binding(self, run, workspace_id: str, document_id: str, scope: list[str]) -> dict:
        """Mint the run's token; return the binding the mnote plugin gets for the run:
        ``{toolUrl, runToken, actorId, workspaceId, documentId, sessionId, runId, traceId,
        capabilityScope}``."""
        if not self.service_url:
            raise RuntimeError("ToolGateway.service_url is not set")
        token = secrets.token_urlsafe(TOKEN_BYTES)
        claims = RunClaims(run.actor_id, workspace_id, document_id, run.session_id, run.run_id,
                           run.trace_id, tuple(scope))
        with self._lock:
            self._tokens[self._digest(token)] = (claims, run)
            self._by_run[run.run_id] = self._digest(token)
        return {
            "toolUrl": self.service_url.rstrip("/") + "/api/hermes/tools/invoke",
            "runToken": token,
            "actorId": claims.actor_id, "workspaceId": workspace_id, "documentId": document_id,
            "sessionId": claims.session_id, "runId": claims.run_id, "traceId": claims.trace_id,
            "capabilityScope": list(scope),
        }

    def end_run(self, run) -> None:
        """Revoke the run's token (the run ended)."""
        with self._lock:
            digest = self._by_run.pop(run.run_id, None)
            if digest:
                self._tokens.pop(digest, None)

    def claims_for(self, authorization: str | None):
        """(claims, run) for a ``Bearer`` token; ToolRefused 401 ``mnote_tool_unauthorized``
        otherwise."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ToolRefused(401, "mnote_tool_unauthorized", "a run token is required")
        digest = self._digest(token.strip())
        with self._lock:
            for known, entry in self._tokens.items():
                if hmac.compare_digest(known, digest):
                    return entry
        raise ToolRefused(401, "mnote_tool_unauthorized", "unknown or expired run token")

    @staticmethod
    def _outside_binding(claims: RunClaims, envelope: dict) -> str | None:
        """Why the envelope leaves the run's page binding, or None.

        A run works in its own workspace; it may read other pages there (the store still
        checks the actor's rights) but writes only to its own page. An id that is not a
        string is no page at all: the executor's schema refuses it as a bad request the model
        can fix (a permission denial would send it the wrong way).
        """
        if not all(isinstance(envelope.get(k), str) for k in ("workspaceId", "documentId")):
            return None
        if envelope.get("workspaceId") != claims.workspace_id:
            return "无页面读取权限"
        name = envelope.get("toolName")     # any JSON value: the executor refuses a non-string
        spec = TOOLS_BY_NAME.get(name) if isinstance(name, str) else None
        if spec is not None and spec.writes and envelope.get("documentId") != claims.document_id:
            return "无页面写权限"
        return None

    def invoke(self, authorization: str | None, envelope) -> dict:
        """Check the token against the envelope, run the tool, return the output envelope.

        Raises :class:`ToolRefused` for token problems and for an envelope naming another
        actor, session or run. Everything else (schemas, permissions, ...) comes back as an
        ``ok: false`` envelope from the executor.
        """
        claims, run = self.claims_for(authorization)
        if run.cancel.is_set() or run.done:
            raise ToolRefused(401, "mnote_tool_unauthorized", "the run has ended or was aborted")
        if not isinstance(envelope, dict):
            raise ToolRefused(400, "mnote_tool_bad_request", "the body must be a JSON object")
        envelope = {k: v for k, v in envelope.items() if v is not None}   # null = absent
        for field, expected in (("actorId", claims.actor_id), ("sessionId", claims.session_id),
                                ("runId", claims.run_id)):
            if envelope.get(field, expected) != expected:
                raise ToolRefused(403, "mnote_tool_permission_denied",
                                  f"{field} does not match the run token")
        envelope = {**envelope, "actorId": claims.actor_id, "sessionId": claims.session_id,
                    "runId": claims.run_id, "traceId": claims.trace_id,
                    "capabilityScope": list(claims.capability_scope)}
        envelope.setdefault("workspaceId", claims.workspace_id)
        envelope.setdefault("documentId", claims.document_id)
        tool, preview = tool_identity(envelope)
        call_id = envelope.get("toolCallId")
        call_id = call_id if isinstance(call_id, str) else None
        run.touch()
        run.emit("tool.started", tool_call_id=call_id, tool_name=tool, preview=preview)
        outside = self._outside_binding(claims, envelope)
        result = self.executor.invoke(envelope, TOOLS_BY_NAME) if outside is None else \
            self.executor.denied(envelope, outside)
        run.touch()
        suggestion = suggestion_created(tool, result)
        if suggestion is not None:
            run.emit("suggestion.created", suggestion_id=suggestion, tool_call_id=call_id,
                     document_id=preview)
        run.emit("tool.completed", tool_call_id=call_id, tool_name=tool, preview=preview,
                 ok=result.get("ok"), error_code=(result.get("error") or {}).get("code"))
        return result


def suggestion_created(tool: str | None, result: dict) -> str | None:
    """The id of the suggestion an ``mnote.block.propose`` call stored (its result's
    ``suggestionId``, an id — a kernel's answer is not trusted further), else None: a dry run,
    a failure, another tool (docs/mnote-client.md §Suggestions)."""
    if tool != "mnote.block.propose" or not result.get("ok") or \
            (result.get("audit") or {}).get("effect") != "write":
        return None
    stored = result.get("result")
    sid = stored.get("suggestionId") if isinstance(stored, dict) else None
    return sid if is_id(sid) else None


def tool_identity(envelope: dict) -> tuple[str | None, str | None]:
    """``(tool_name, preview)`` of an mnote tool call for its events (docs/mnote-client.md
    §Tool events): the tool's contract name (``mnote.page.get``, as ``GET /tools`` lists it;
    None for a name that is no mnote tool — the call is refused) and the page it reads or
    writes (``documentId``)."""
    name = envelope.get("toolName")
    spec = TOOLS_BY_NAME.get(name) if isinstance(name, str) else None
    page = envelope.get("documentId")
    return (spec.name if spec else None), (page if isinstance(page, str) and page else None)

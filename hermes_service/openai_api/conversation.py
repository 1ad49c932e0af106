"""Which Hermes session an OpenAI-compatible request continues, and the message its turn runs
(docs/openai-api.md §Conversations).

A request's ``messages`` are read as ``(role, text)`` pairs (:func:`read_messages`: the
``developer`` role is ``system``; content parts are text only). Then (:func:`plan`):

1. ``X-Hermes-Session-Id`` names a session this service made for this user (another user's or
   an unknown id: 404 ``session_not_found``): the turn is the last user message, on that
   session — the earlier messages are what the session already holds;
2. otherwise the history before the last message is matched by its digest (SHA-256 of the
   pairs, texts stripped) against the history each of this user's sessions reached after
   its last answer (``history_sha256`` on the session record): a match continues that
   session with the last message;
3. otherwise (a first message, an edited, regenerated or made-up history) a new session
   starts, and its first turn's message carries the history as text (:func:`seeded`): the
   system messages as the client's instructions, the earlier turns as a transcript, then the
   new message. That turn is Hermes's record of the conversation from then on.

After each answer the session stores the digest of the history including it
(:func:`history_digest`), so the client's next request, which sends it back, matches.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..errors import BadRequest

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _unsupported(detail: str, param: str, code: str = "unsupported_content") -> BadRequest:
    return BadRequest(detail, code=code, extra={"param": param})


def read_messages(messages: list[dict]) -> list[tuple[str, str]]:
    """``(role, text)`` of each message; 400 ``unsupported_content`` for a part that is not
    text (images, audio, files) and ``tools_unsupported`` for a tool or function message
    (the client's own tools: docs/openai-api.md §What is not supported); 400
    ``invalid_request`` unless the last message is the user's."""
    out = []
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role not in _ROLES:
            raise _unsupported(f"messages[{i}]: role {role} carries a result of the client's "
                               "own tools, which this service does not call",
                               f"messages[{i}].role", "tools_unsupported")
        if msg.get("tool_calls") or msg.get("function_call"):
            raise _unsupported(f"messages[{i}]: tool calls of the client's own tools are not "
                               "supported", f"messages[{i}].tool_calls", "tools_unsupported")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _unsupported(f"messages[{i}].content[{j}]: only text parts are "
                                       f"supported (not {part.get('type')!r})",
                                       f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append((_ROLES[role], content or ""))
    if out[-1][0] != "user" or not out[-1][1].strip():
        raise BadRequest("the last message must be the user's, with text", code="invalid_request",
                         extra={"param": "messages"})
    return out


def history_digest(pairs: list[tuple[str, str]]) -> str:
    """SHA-256 (hex) of a history: the pairs' roles and stripped texts, as JSON."""
    canon = json.dumps([[r, t.strip()] for r, t in pairs], ensure_ascii=False,
                       separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


def seeded(pairs: list[tuple[str, str]]) -> str:
    """The first turn's message of a new session from the client's whole history ``pairs``
    (its last is the user's new message): the message alone when nothing came before it, else
    the system messages and the earlier turns as labelled text before it."""
    *earlier, (_, last) = pairs
    system = [t for r, t in earlier if r == "system" and t.strip()]
    turns = [(r, t) for r, t in earlier if r != "system"]
    if not system and not turns:
        return last
    parts = []
    if system:
        parts.append("[Instructions from the client application for this conversation]\n"
                     + "\n\n".join(system))
    if turns:
        parts.append("[The conversation so far]\n" + "\n\n".join(
            f"{'User' if r == 'user' else 'Assistant'}: {t}" for r, t in turns))
    parts.append("[The user's new message]\n" + last)
    return "\n\n".join(parts)


@dataclass(frozen=True)
class Plan:
    """Where a request's turn runs: ``session_id`` (None: a new session), the ``message``
    Hermes runs, and the digest of the history before it (``prior``)."""
    session_id: str | None
    message: str
    prior: str


def plan(sessions: list[dict], pairs: list[tuple[str, str]], named: dict | None) -> Plan:
    """The :class:`Plan` of a request with ``pairs`` (:func:`read_messages`): ``named`` is the
    record ``X-Hermes-Session-Id`` named (already checked to be this user's), ``sessions``
    this user's sessions of the family (their ``history_sha256`` is matched)."""
    prior = history_digest(pairs[:-1])
    if named is not None:
        return Plan(named["session_id"], pairs[-1][1], prior)
    if len(pairs) > 1:
        for rec in reversed(sessions):             # the newest first
            if rec.get("history_sha256") == prior:
                return Plan(rec["session_id"], pairs[-1][1], prior)
    return Plan(None, seeded(pairs), prior)

"""Front-end chores answered without an agent turn (docs/openai-api.md §Front-end chores).

Open WebUI (and front ends like it) send the chat's model its own small jobs — a title, tags,
follow-up questions, search queries — as ordinary chat completions. Run as agent turns they
would cost a Hermes turn each, open sessions in the user's home and fill its memory. With
``openai.task_mode: local`` (the default) such a request is recognised — ``metadata.task``
names a task, or the last user message is a task prompt (Open WebUI's templates begin with
``### Task:``) — and answered here at once, with the JSON its template asks for
(``JSON format: { "title": … }``): ``title`` is the chat's first user line cut to
:data:`TITLE_WORDS` words, every other key an empty list. Nothing reaches Hermes or the model,
no token is counted. ``openai.task_mode: agent`` runs them as ordinary turns.
"""
from __future__ import annotations

import json
import re

TASK_PREFIX = "### Task:"
TITLE_WORDS = 6
_KEY = re.compile(r'JSON format:\s*\{\s*"([A-Za-z_]{1,40})"')
_HISTORY = re.compile(r"<chat_history>\s*(.*?)</chat_history>", re.S)
_FIRST_USER = re.compile(r"^USER:\s*(.+)$", re.M)


def task_of(body: dict, last_user: str) -> str | None:
    """The task a request is (``metadata.task``, or ``prompt`` for a task prompt), None for a
    conversation turn."""
    meta = body.get("metadata")
    task = meta.get("task") if isinstance(meta, dict) else None
    if isinstance(task, str) and task:
        return task[:64]
    return "prompt" if last_user.lstrip().startswith(TASK_PREFIX) else None


def answer(prompt: str) -> str:
    """The local answer to a task prompt: the JSON object its template asks for, or an empty
    text when it asks for none."""
    found = _KEY.search(prompt)
    if found is None:
        return ""
    key = found.group(1)
    return json.dumps({key: _title(prompt) if key == "title" else []}, ensure_ascii=False)


def _title(prompt: str) -> str:
    history = _HISTORY.search(prompt)
    first = _FIRST_USER.search(history.group(1)) if history else None
    words = (first.group(1) if first else "New chat").split()
    return " ".join(words[:TITLE_WORDS]) or "New chat"

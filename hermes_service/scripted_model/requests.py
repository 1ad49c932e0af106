"""Reading a chat-completions request the way the scripted model does (docs/testing.md §The
scripted model): the text of its messages, the turn's last user message and Hermes's nudges
after it, whether it is one of Hermes's auxiliary calls, the tools it offers, and the
``[[tools:…]]`` directive."""
from __future__ import annotations

import json
import re
from typing import Any

AUX_REPLY = "Scripted test conversation"

# Start of system prompts used by Hermes auxiliary tasks.
AUX_SYSTEM_PREFIXES = (
    "Generate a short, descriptive title",  # agent/title_generator.py
)
# Start of the last user message of Hermes auxiliary agents.
AUX_USER_PREFIXES = (
    "Review the conversation above",  # agent/background_review.py
)
# Substring of the Hermes main agent system prompt (SOUL.md / prompt_builder).
AUX_MAIN_MARKER = "Hermes Agent"

#: How Hermes's own user-role nudges begin (a continuation after a cut reply, …)
NUDGE_PREFIX = "[System: "
_TOOLS_START = "[[tools:"
_NAME_RE = re.compile(r"[A-Za-z0-9_.:\-]+")


def content_text(content: Any) -> str:
    """Text of an OpenAI message ``content`` (string or list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    out.append(part["text"])
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)


def messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    return [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []


def last_user_index(msgs: list[dict]) -> int:
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].get("role") == "user":
            return i
    return -1


def asked_text(msgs: list[dict]) -> str:
    """The last user message that is not one of Hermes's own ``[System: …`` nudges."""
    for m in reversed(msgs):
        if m.get("role") == "user":
            text = content_text(m.get("content"))
            if not text.lstrip().startswith(NUDGE_PREFIX):
                return text
    return ""


def nudges(msgs: list[dict]) -> int:
    """Hermes's ``[System: …`` nudges after the last real user message."""
    count = 0
    for m in reversed(msgs):
        if m.get("role") == "user":
            if not content_text(m.get("content")).lstrip().startswith(NUDGE_PREFIX):
                return count
            count += 1
    return count


def last_user_text(body: dict) -> str:
    msgs = messages(body)
    i = last_user_index(msgs)
    return content_text(msgs[i].get("content")) if i >= 0 else ""


def system_text(msgs: list[dict]) -> str:
    for m in msgs:
        if m.get("role") in ("system", "developer"):
            return content_text(m.get("content"))
    return ""


def is_auxiliary(body: dict) -> bool:
    """True for Hermes side calls (title generation etc.); see module doc."""
    msgs = messages(body)
    system = system_text(msgs).lstrip()
    if any(system.startswith(p) for p in AUX_SYSTEM_PREFIXES):
        return True
    li = last_user_index(msgs)
    if li >= 0:
        last = content_text(msgs[li].get("content")).lstrip()
        if any(last.startswith(p) for p in AUX_USER_PREFIXES):
            return True
    if body.get("stream") is True or body.get("scripted_main") is True:
        return False
    first_is_main_system = bool(msgs) and msgs[0].get("role") in ("system", "developer") \
        and AUX_MAIN_MARKER in system
    return not first_is_main_system


def offered_tools(body: dict) -> list[str]:
    names = []
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            fn: dict = t["function"] if isinstance(t.get("function"), dict) else t
            name = fn.get("name")
            if isinstance(name, str):
                names.append(name)
    return names


def parse_tool_directive(text: str) -> list[tuple[str, dict]] | None:
    """Parse the first ``[[tools:...]]`` directive in *text*.

    Returns a list of ``(name, args)`` or None when there is no (valid)
    directive.
    """
    start = text.find(_TOOLS_START)
    if start < 0:
        return None
    pos = start + len(_TOOLS_START)
    decoder = json.JSONDecoder()
    calls: list[tuple[str, dict]] = []
    n = len(text)

    def skip_ws(p: int) -> int:
        while p < n and text[p].isspace():
            p += 1
        return p

    while True:
        pos = skip_ws(pos)
        m = _NAME_RE.match(text, pos)
        if not m:
            return None
        name = m.group(0)
        pos = skip_ws(m.end())
        args: Any = {}
        if pos < n and text[pos] == "{":
            try:
                args, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            pos = skip_ws(pos)
        calls.append((name, args))
        if text.startswith("]]", pos):
            return calls
        if pos < n and text[pos] == ";":
            pos += 1
            continue
        return None


def approx_tokens(obj: Any) -> int:
    return max(1, len(json.dumps(obj, ensure_ascii=False)) // 4)

"""What the scripted model answers (docs/testing.md §The scripted model): the directives in the
last user message, read into a :class:`Plan` (an error, a hang, text, a tool call) with its
modifiers (slow, reasoning, cut, length, usage)."""
from __future__ import annotations

import re
from typing import Any

from .requests import (
    AUX_REPLY,
    NUDGE_PREFIX,
    asked_text,
    content_text,
    is_auxiliary,
    last_user_index,
    messages,
    nudges,
    offered_tools,
    parse_tool_directive,
)

_STATUS_RE = re.compile(r"\[\[status:(\d{3})\]\]")
_HANG_RE = re.compile(r"\[\[hang\]\]")
GATE_RE = re.compile(r"\[\[gate:([A-Za-z0-9_-]+)\]\]")
_SLOW_RE = re.compile(r"\[\[slow:(\d+(?:\.\d+)?)(?::(\d+))?\]\]")
_RECALL_RE = re.compile(r"\[\[recall\]\]")
_OFFERED_RE = re.compile(r"\[\[tools-offered\]\]")
_REASONING_RE = re.compile(r"\[\[reasoning\]\]")
_THINK_RE = re.compile(r"\[\[think\]\]")
_EMPTY_RE = re.compile(r"\[\[empty\]\]")
_CUT_RE = re.compile(r"\[\[cut\]\]")
_CUT_EVERY_RE = re.compile(r"\[\[cut-every\]\]")
_NO_USAGE_RE = re.compile(r"\[\[no-usage\]\]")
_SURROGATE_RE = re.compile(r"\[\[surrogate\]\]")
_LENGTH_RE = re.compile(r"\[\[length\]\]")
_USAGE_RE = re.compile(r"\[\[usage:(\d+)\]\]")
_THEN_HANG_RE = re.compile(r"\[\[then-hang\]\]")
_NARRATE_RE = re.compile(r"\[\[narrate\]\]")

#: What ``[[reasoning]]`` / ``[[think]]`` send as the model's private reasoning.
REASONING_TEXT = "PRIVATE-REASONING: the user wants an answer; think it over step by step first."


class Plan:
    """What to answer: an HTTP error, a hang, text, or one tool call."""

    def __init__(self, kind: str, **kw: Any) -> None:
        self.kind = kind  # "error" | "hang" | "text" | "tool_call"
        self.status: int = kw.get("status", 200)
        self.text: str = kw.get("text", "")
        self.tool_name: str = kw.get("tool_name", "")
        self.tool_args: dict = kw.get("tool_args", {})
        self.slow: float = kw.get("slow", 0.0)
        self.pieces: int = kw.get("pieces", 5)          # text pieces of a slow reply
        self.reasoning: str = kw.get("reasoning", "")   # streamed as reasoning_content
        self.cut: bool = kw.get("cut", False)           # drop the stream mid-answer
        self.prompt_tokens: int | None = kw.get("prompt_tokens")
        self.finish: str = kw.get("finish", "stop")      # finish_reason of a text reply
        self.no_usage: bool = kw.get("no_usage", False)  # report no usage at all


def plan_reply(body: dict, cut_done: set | None = None) -> Plan:
    """The reply to one chat-completions request (see the module doc for directives).

    ``cut_done`` (shared per server) remembers the ``[[cut]]`` messages already cut once.
    """
    plan = _plan_reply(body)
    if is_auxiliary(body):
        return plan
    msgs = messages(body)
    plan.no_usage = bool(_NO_USAGE_RE.search(asked_text(msgs)))
    if plan.kind != "text":
        return plan
    li = last_user_index(msgs)
    user_text = content_text(msgs[li].get("content")) if li >= 0 else ""
    if _EMPTY_RE.search(user_text):
        plan.text = ""
    if _SURROGATE_RE.search(user_text):
        plan.text += "\ud83d!"
    if _THINK_RE.search(user_text):
        plan.text = f"<think>{REASONING_TEXT}</think>" + plan.text
    if _REASONING_RE.search(user_text):
        plan.reasoning = REASONING_TEXT
    m = _USAGE_RE.search(user_text)
    if m:
        plan.prompt_tokens = int(m.group(1))
    if _LENGTH_RE.search(asked_text(msgs)):
        plan.finish = "length"
        if user_text.lstrip().startswith(NUDGE_PREFIX):      # Hermes asks for the rest
            plan.text = f"(continued, part {nudges(msgs) + 1})"
    _cuts(plan, msgs, user_text, cut_done)
    return plan


def _cuts(plan: Plan, msgs: list[dict], user_text: str, cut_done: set | None) -> None:
    """``[[cut]]`` (the first request carrying it) and ``[[cut-every]]`` (every try)."""
    if _CUT_RE.search(user_text) and cut_done is not None and user_text not in cut_done:
        cut_done.add(user_text)
        plan.cut = True
    if _CUT_EVERY_RE.search(asked_text(msgs)):
        plan.cut = True
        if user_text.lstrip().startswith(NUDGE_PREFIX):      # Hermes asks for the rest
            plan.text = f"(continued, part {nudges(msgs) + 1}) and more"


def _plan_reply(body: dict) -> Plan:
    if is_auxiliary(body):
        return Plan("text", text=AUX_REPLY)
    msgs = messages(body)
    li = last_user_index(msgs)
    user_text = content_text(msgs[li].get("content")) if li >= 0 else ""
    slow_m = _SLOW_RE.search(user_text)
    slow = float(slow_m.group(1)) if slow_m else 0.0
    pieces = int(slow_m.group(2)) if slow_m and slow_m.group(2) else 5

    m = _STATUS_RE.search(user_text)
    if m:
        return Plan("error", status=int(m.group(1)))
    if _HANG_RE.search(user_text):
        return Plan("hang")
    calls = parse_tool_directive(user_text)
    if calls is not None:
        after = msgs[li + 1 :] if li >= 0 else []
        results = [content_text(x.get("content")) for x in after if x.get("role") == "tool"]
        step = len(results)
        if step < len(calls):
            name, args = calls[step]
            if name not in offered_tools(body):
                return Plan("text", text=f"tool not offered: {name}", slow=slow, pieces=pieces)
            return Plan("tool_call", tool_name=name, tool_args=args,
                         text=f"calling {name}." if _NARRATE_RE.search(user_text) else "")
        if _THEN_HANG_RE.search(user_text):
            return Plan("hang")
        return Plan("text", text="tools done: " + " || ".join(results), slow=slow, pieces=pieces)
    if _OFFERED_RE.search(user_text):
        names = sorted(offered_tools(body))
        return Plan("text", text=",".join(names) if names else "(none)", slow=slow, pieces=pieces)
    user_msgs = [content_text(x.get("content")) for x in msgs if x.get("role") == "user"]
    if _RECALL_RE.search(user_text):
        return Plan("text", text=" | ".join(user_msgs[:-1]), slow=slow, pieces=pieces)
    return Plan("text", text=f"echo #{len(user_msgs)}: {user_text}", slow=slow, pieces=pieces)

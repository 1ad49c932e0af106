"""What Hermes's record shows (hermes-agent 0.19.0; docs/runners.md §Answers, client-proxy
contract §2 ``GET /sessions/{id}``): the shaping of the rows
:mod:`hermes_service.homes.hermes_state` reads, apart from reading them.

* :func:`display_content` — what a stored message shows, or None for Hermes's scaffolding
  (context-compaction summaries, continuation nudges, background-review turns); a summary
  merged into a real message is unwrapped back to it (:func:`unwrap_merged`);
* :func:`said` — what the model wrote in a turn's rows: each tool-call step's text and the
  final answer (joined with :data:`TOOL_BREAK`, as the ACP runner streams it);
* :func:`tool_calls`, :func:`first_call`, :func:`reasoning`, :func:`replayed` — a row's tool
  calls (a JSON column, parsed at a bounded cost), its reasoning, Hermes's replayed-user
  dedup.

Pure functions of the values read: nothing here opens a file.
"""
from __future__ import annotations

import re

from ..json_cost import loads_bounded

#: Hermes's failure sentinel for a turn whose model returned no content
# (agent/conversation_loop.py).
EMPTY_SENTINEL = "(empty)"
#: Context-compaction summary prefixes (agent/context_compressor.py: SUMMARY_PREFIX, legacy).
SUMMARY_PREFIXES = ("[CONTEXT COMPACTION", "[CONTEXT SUMMARY]:")
#: A summary merged into the first kept message wraps that message's own content.
MERGED_HEADER = "[PRIOR CONTEXT — for reference only; not a new message]"
MERGED_DELIMITER = "[END OF PRIOR CONTEXT — COMPACTION SUMMARY BELOW]"
#: User-role messages Hermes writes itself (agent/conversation_compression.py and friends).
SYNTHETIC_USER_PREFIXES = (
    "[System: ",
    "[Your active task list was preserved across context compression]",
    "[IMPORTANT: Background process ",
    "Review the conversation above",
)
#: the most values (json_cost.py) of a JSON column the service parses (a tool call list, a
#: tool result): Hermes's hold a few dozen, their long strings counting one each
JSON_VALUES = 4096


def unwrap_merged(text: str) -> str:
    """The message a merged compaction summary wraps, at any depth.

    Hermes merges a summary into the first kept message as ``HEADER\n<old>\n\nDELIMITER\n\n
    <summary>\n\n<end marker>`` (agent/context_compressor.py, ``compress``, merge into the
    tail); when a later compaction merges into that same message, ``<old>`` is the previous
    merge, so ``n`` compactions give ``n`` headers, then the original content, then ``n``
    delimiter+summary parts. The original is what follows the last leading header, up to the
    first delimiter (a summary may quote the delimiter; a real message does not). ``text``
    without a header and a delimiter is returned as it is; past :data:`MAX_MERGES` leading
    headers the rest is the message."""
    headers = _HEADERS.match(text)
    if headers is None:
        return text
    end = text.find(MERGED_DELIMITER, headers.end())
    if end < 0:
        return text
    return text[headers.end():end].strip()


#: the most compactions merged into one message that are unwrapped: Hermes makes one per
#: compaction of a conversation (a handful); a row of more (79 000 in 4 MiB) is a planted one,
#: whose headers past these are shown as its text
MAX_MERGES = 1000
#: the leading headers of a merged summary, each followed by any whitespace: one bounded match
#: (it was one copy of the rest of the text per header: ~30 s for 4 MiB of headers)
_HEADERS = re.compile(r"(?:" + re.escape(MERGED_HEADER) + r"\s*){1,%d}" % MAX_MERGES)


def display_content(role: str, content) -> str | None:
    """What a stored message shows, or None for Hermes's internal scaffolding (summaries,
    nudges). A summary merged into a real message is unwrapped back to that message, however
    many compactions merged into it (:func:`unwrap_merged`)."""
    if not isinstance(content, str):
        return content
    text = content.lstrip()
    inner = unwrap_merged(text) if text.startswith(MERGED_HEADER) else text
    if inner is not text:
        # the message kept before the summaries; itself perhaps an earlier summary or nudge
        if inner.startswith(MERGED_HEADER):       # past MAX_MERGES: not Hermes's; as it is
            return inner
        return display_content(role, inner)
    if text.startswith(SUMMARY_PREFIXES):
        return None
    if role == "user" and text.startswith(SYNTHETIC_USER_PREFIXES):
        return None
    return content


def reasoning(row) -> str | None:
    return row["reasoning_content"] or row["reasoning"] or None


#: the paragraph break Hermes streams between the text before a tool call and the text after
#: it (``run_agent._fire_stream_delta``: ``_stream_needs_break``)
TOOL_BREAK = "\n\n"


def calls_tools(r) -> bool:
    return bool(r["tool_calls"]) and r["tool_calls"] not in ("[]", "null")


def said(rows) -> tuple[list[str], str]:
    """What the model wrote in ``rows`` (a turn's rows after its user message): the text of
    each tool-call step up to its call, and the text after the last call (its final answer;
    "" when none), each stripped as Hermes stores it. A turn's whole text is the non-empty
    ones joined with :data:`TOOL_BREAK` — exactly what the ACP runner streams
    (docs/mnote-client.md §Events: the deltas add up to ``output``)."""
    steps, current = [], []
    for r in rows:
        if r["role"] != "assistant":
            continue
        text = display_content("assistant", r["content"])
        if isinstance(text, str) and text != EMPTY_SENTINEL:
            current.append(text)
        if calls_tools(r):
            steps.append("".join(current).strip())
            current = []
    return steps, "".join(current).strip()


def tool_calls(tool_calls_json: str | None) -> list:
    """The tool calls of an assistant row's ``tool_calls`` (a JSON list; [] for anything
    else, or one of more than :data:`JSON_VALUES` values)."""
    try:
        calls = loads_bounded(tool_calls_json or "[]", JSON_VALUES)
    except ValueError:
        return []
    return calls if isinstance(calls, list) else []


def first_call(calls: list) -> tuple[str | None, str | None]:
    """``(id, function name)`` of the first call, each None unless a string."""
    first = calls[0] if calls and isinstance(calls[0], dict) else {}
    fn = first.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    call_id = first.get("id")
    return (call_id if isinstance(call_id, str) else None,
            name if isinstance(name, str) else None)


def replayed(out: list[dict], content) -> bool:
    """Hermes's replayed-user dedup: the same user text again with no answer in between."""
    for prev in reversed(out):
        if prev["role"] == "user":
            return prev["content"] == content
        if prev["role"] == "assistant" and (prev["content"] or prev["tool_calls"]):
            return False
    return False

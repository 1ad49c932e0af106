"""The shape of a chat completions request the model pass-through forwards, object by object
(docs/sandbox.md §What the pass-through forwards): every object's keys from an allowlist,
every value of the type and range the OpenAI API gives it.

What is allowed is what Hermes 0.19.0 sends to a ``custom`` provider — read in its code
(``agent/transports/chat_completions.py``: ``convert_messages``, ``build_kwargs``;
``agent/conversation_loop.py``: the API copy of each message; ``agent/prompt_caching.py``:
``cache_control`` markers) and recorded from real turns — plus the plain OpenAI sampling
fields. Refused because a provider would act on them beyond answering text: content parts
other than ``text`` (``image_url``, ``file``, ``input_audio``: the provider fetches an
agent-chosen URL past the sandbox's egress policy, or reads the operator's files by id), tools
other than ``function`` (``web_search_preview``, ``openrouter:web_search``…: searches billed to
the operator), and every key a provider might read that Hermes does not send. Numbers are
finite and bounded (:data:`MAX_OUTPUT_TOKENS`).

:data:`CHAT_REQUEST` is the rule of the whole body; :func:`check` applies it, raising
:class:`Invalid` (``code``: ``unsupported_parameter`` for a key not forwarded,
``invalid_request_body`` for a value; the message names the path, e.g.
``messages[3].content[0].type``). A check is a function of the value; containers add their
key or index to the path of an error from inside them (nothing is built while a body is
valid: a 50 KB request is checked in ~0.1 ms).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

#: the most output tokens a request may ask for (``max_tokens``, ``max_completion_tokens``,
#: ``reasoning.max_tokens``): 2**20, past every model's output limit (Hermes asks 65 536)
MAX_OUTPUT_TOKENS = 1 << 20
#: stop sequences (the OpenAI API's own limit)
MAX_STOP = 4

Check = Callable[[Any], None]


class Invalid(ValueError):
    """A request body of another shape: ``code`` (``unsupported_parameter`` |
    ``invalid_request_body``), ``path`` (``messages[3].role``), ``what`` (what is wrong)."""

    def __init__(self, what: str, code: str = "invalid_request_body", path: str = ""):
        super().__init__(what)
        self.what, self.code, self.path = what, code, path

    def under(self, step: str) -> Invalid:
        sep = "" if not self.path or self.path.startswith("[") else "."
        self.path = step + sep + self.path
        return self

    @property
    def message(self) -> str:
        return f"{self.path}: {self.what}" if self.path else self.what


def check(obj: Any, rule: Check | None = None) -> None:
    """Apply ``rule`` (default :data:`CHAT_REQUEST`) to a parsed body; raises
    :class:`Invalid`."""
    (rule or CHAT_REQUEST)(obj)


def _name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), "a value")


# -- scalar checks ----------------------------------------------------------------------------
def string(v: Any) -> None:
    if not isinstance(v, str):
        raise Invalid(f"must be a string, not {_name(v)}")


def boolean(v: Any) -> None:
    if not isinstance(v, bool):
        raise Invalid(f"must be a boolean, not {_name(v)}")


def integer(lo: int, hi: int) -> Check:
    def integer_in(v: Any) -> None:
        if type(v) is not int or not lo <= v <= hi:
            raise Invalid(f"must be an integer from {lo} to {hi}")
    return integer_in


def number(lo: float, hi: float) -> Check:
    def number_in(v: Any) -> None:
        if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
            raise Invalid(f"must be a number from {lo:g} to {hi:g}")
    return number_in


def one_of(*values: Any) -> Check:
    allowed = frozenset(values)

    def in_set(v: Any) -> None:
        if not isinstance(v, (str, bool)) or v not in allowed:
            raise Invalid(f"must be one of {', '.join(sorted(map(str, allowed)))}")
    return in_set


def anything(v: Any) -> None:
    """Free-form JSON (a tool's parameter schema): what a provider reads as data only."""


def null(v: Any) -> None:
    if v is not None:
        raise Invalid(f"must be null, not {_name(v)}")


def either(*checks: Check, what: str) -> Check:
    """The first check ``v`` passes; else :class:`Invalid` ``what`` — or the error of the
    check whose type matches (an object or an array: its inner error, with its path)."""
    def first_of(v: Any) -> None:
        inner = None
        for c in checks:
            try:
                c(v)
                return
            except Invalid as exc:
                if exc.path and inner is None:
                    inner = exc
        raise inner or Invalid(what)
    return first_of


# -- containers -------------------------------------------------------------------------------
def obj(fields: Mapping[str, Check], required: tuple[str, ...] = ()) -> Check:
    """An object whose keys are in ``fields`` (each value checked by its check), with every
    key of ``required``."""
    def an_object(v: Any) -> None:
        if not isinstance(v, dict):
            raise Invalid(f"must be an object, not {_name(v)}")
        for k, item in v.items():
            c = fields.get(k)
            if c is None:
                raise Invalid(f"{str(k)[:100]!r} is not forwarded by this endpoint (here: "
                              f"{', '.join(sorted(fields))})", "unsupported_parameter")
            try:
                c(item)
            except Invalid as exc:
                raise exc.under(str(k)[:100]) from None
        for k in required:
            if k not in v:
                raise Invalid(f"{k!r} is required")
    return an_object


def array(item: Check, max_items: int | None = None) -> Check:
    def an_array(v: Any) -> None:
        if not isinstance(v, list):
            raise Invalid(f"must be an array, not {_name(v)}")
        if max_items is not None and len(v) > max_items:
            raise Invalid(f"must hold at most {max_items} items")
        for i, x in enumerate(v):
            try:
                item(x)
            except Invalid as exc:
                raise exc.under(f"[{i}]") from None
    return an_array


def tagged(tag: str, kinds: Mapping[str, Check]) -> Check:
    """An object whose ``tag`` key says which of ``kinds`` it is (its rule)."""
    def a_kind(v: Any) -> None:
        kind = v.get(tag) if isinstance(v, dict) else None
        c = kinds.get(kind) if isinstance(kind, str) else None
        if c is None:
            if not isinstance(v, dict):
                raise Invalid(f"must be an object, not {_name(v)}")
            if tag not in v:
                raise Invalid(f"{tag!r} is required")
            raise Invalid(f"{str(kind)[:100]!r} is not forwarded by this endpoint (here: "
                          f"{', '.join(sorted(kinds))})", "unsupported_parameter", tag)
        c(v)
    return a_kind


# -- the chat completions request ----------------------------------------------------------
#: Anthropic prompt-caching marker Hermes adds (agent/prompt_caching.py)
CACHE_CONTROL = obj({"type": one_of("ephemeral"), "ttl": one_of("5m", "1h")}, ("type",))
#: content parts: text only
TEXT_PART = obj({"type": one_of("text"), "text": string, "cache_control": CACHE_CONTROL},
                ("type", "text"))
CONTENT = either(string, null, array(tagged("type", {"text": TEXT_PART})),
                 what="must be a string, null or an array of text parts")
FUNCTION_CALL = obj({"name": string, "arguments": string}, ("name",))
TOOL_CALL = tagged("type", {"function": obj({
    "id": string, "type": one_of("function"), "function": FUNCTION_CALL,
    "index": integer(0, 1 << 16),
    # Gemini's thought signature, replayed by Hermes to Gemini models
    "extra_content": obj({"google": obj({"thought_signature": string})})}, ("function",))})
#: OpenRouter's unified reasoning items, echoed back by Hermes
REASONING_DETAIL = obj({k: either(string, null, integer(0, 1 << 31), what="must be a string, "
                                  "an integer or null")
                        for k in ("type", "summary", "text", "data", "signature", "format", "id",
                                  "index")}, ("type",))
MESSAGE = tagged("role", {
    "system": obj({"role": string, "content": CONTENT, "name": string,
                   "cache_control": CACHE_CONTROL}),
    "developer": obj({"role": string, "content": CONTENT, "name": string}),
    "user": obj({"role": string, "content": CONTENT, "name": string,
                 "cache_control": CACHE_CONTROL}),
    "assistant": obj({"role": string, "content": CONTENT, "name": string,
                      "tool_calls": array(TOOL_CALL, 1024), "reasoning_content": string,
                      "reasoning_details": array(REASONING_DETAIL, 1024), "refusal":
                      either(string, null, what="must be a string or null"),
                      "cache_control": CACHE_CONTROL}),
    "tool": obj({"role": string, "content": CONTENT, "tool_call_id": string, "name": string,
                 "cache_control": CACHE_CONTROL}),
})
TOOL = tagged("type", {"function": obj({
    "type": one_of("function"),
    "function": obj({"name": string, "description": string, "parameters": anything,
                     "strict": boolean}, ("name",)),
    "cache_control": CACHE_CONTROL}, ("function",))})
TOOL_CHOICE = either(one_of("none", "auto", "required"),
                     obj({"type": one_of("function"), "function": obj({"name": string},
                                                                       ("name",))}),
                     what="must be none, auto, required or a function")
TOKENS = integer(1, MAX_OUTPUT_TOKENS)
EFFORT = one_of("none", "minimal", "low", "medium", "high", "xhigh")
#: the top-level fields (model_policy.CHAT_FIELDS names the same set)
CHAT_REQUEST_FIELDS: dict[str, Check] = {
    "model": string,
    "messages": array(MESSAGE),
    "tools": array(TOOL, 1024),
    "tool_choice": TOOL_CHOICE,
    "parallel_tool_calls": boolean,
    "stream": boolean,
    "stream_options": obj({"include_usage": anything}),
    "max_tokens": TOKENS,
    "max_completion_tokens": TOKENS,
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "stop": either(string, null, array(string, MAX_STOP),
                   what=f"must be a string or an array of at most {MAX_STOP} strings"),
    "seed": integer(-(1 << 63), (1 << 63) - 1),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "response_format": tagged("type", {
        "text": obj({"type": string}),
        "json_object": obj({"type": string}),
        "json_schema": obj({"type": string, "json_schema": obj({
            "name": string, "description": string, "schema": anything, "strict": boolean},
            ("name",))}, ("json_schema",))}),
    "reasoning_effort": EFFORT,
    "reasoning": obj({"effort": EFFORT, "enabled": boolean, "exclude": boolean,
                      "max_tokens": TOKENS}),
    "think": boolean,
}
CHAT_REQUEST = obj(CHAT_REQUEST_FIELDS)

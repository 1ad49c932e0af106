"""The frames of a streamed chat completion (docs/openai-api.md §Streams), as OpenAI's API
writes them: Server-Sent Events of ``data: <chat.completion.chunk JSON>`` only (no ``event:``
names, no ids), then ``data: [DONE]``.

Order: the first chunk carries ``delta: {"role": "assistant", "content": ""}``; each piece of
the answer is a chunk of ``delta: {"content"}``; the answer's last chunk has ``delta: {}`` and
its ``finish_reason``; then — only when the request asked ``stream_options.include_usage`` —
one chunk with ``choices: []`` and ``usage``; then ``[DONE]``. Every choice carries ``index``,
``delta``, ``logprobs`` (null) and ``finish_reason`` (null until the last). A turn that fails
after the stream began ends it with one ``data: {"error": {…}}`` frame (the routes' error
shape; the SDKs raise it as ``APIError``) and no ``[DONE]``. Opt-in (request header
``X-Hermes-Tool-Events: comments``): the turn's tool calls as SSE comments
``: hermes.tool {"event", "name", "ok", "preview"}``, which every client skips unless it
reads them.
"""
from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"
#: an SSE comment every this many seconds while a turn is quiet (tool calls, a slow model):
#: proxies keep the connection, clients ignore it, and a gone client is noticed
KEEPALIVE_SECONDS = 15.0


def frame(data: dict) -> str:
    """One ``data:`` frame; UTF-8 text as is unless a string holds a lone surrogate (a
    streamed delta may), which then travels as a ``\\uXXXX`` escape."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


def comment(name: str, data: dict) -> str:
    """An SSE comment line ``: <name> <json>`` (ASCII JSON: no line break can end it early);
    every SSE client, the SDKs included, skips comments."""
    return f": {name} {json.dumps(data, separators=(',', ':'))}\n\n"


def usage_of(tokens: dict) -> dict:
    """OpenAI's ``usage`` of :func:`hermes_service.hermes_state.tokens_used`'s counts."""
    return {"prompt_tokens": tokens["input_tokens"],
            "completion_tokens": tokens["output_tokens"],
            "total_tokens": tokens["total_tokens"]}


class Chunks:
    """The chunks of one completion ``completion_id`` (created ``created``, Unix seconds) of
    ``model``."""

    def __init__(self, completion_id: str, created: int, model: str):
        self.head = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                     "model": model}

    def _choice(self, delta: dict, finish_reason: str | None = None) -> str:
        return frame({**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish_reason}]})

    def role(self) -> str:
        return self._choice({"role": "assistant", "content": ""})

    def content(self, text: str) -> str:
        return self._choice({"content": text})

    def finish(self, reason: str | None) -> str:
        return self._choice({}, reason or "stop")

    def usage(self, tokens: dict) -> str:
        return frame({**self.head, "choices": [], "usage": usage_of(tokens)})


def completion(completion_id: str, created: int, model: str, answer: str,
               finish_reason: str | None, tokens: dict) -> dict:
    """The ``chat.completion`` object of a whole answer."""
    return {"id": completion_id, "object": "chat.completion", "created": created,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer,
                                                 "refusal": None, "annotations": []},
                         "logprobs": None, "finish_reason": finish_reason or "stop"}],
            "usage": usage_of(tokens)}

"""The OpenAI-compatible routes' request and reply shapes, as JSON Schema (the OpenAPI
document and the request check share them; docs/openai-api.md §Routes).

The request schema checks what the service reads and lets every other field of OpenAI's
Create Chat Completion request through (clients send many: ``temperature``, ``user``,
``metadata`` …; they are accepted and ignored, docs/openai-api.md §What is not supported
says which are refused instead)."""
from __future__ import annotations

from ..runner import FINISH_REASON
from ..web.helpers import Param
from .settings import MODEL_ID

_TEXT_PART = {"type": "object", "required": ["type"],
              "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        # one branch per type (a type list with items is read as a union with an untyped
        # string by client generators)
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART},
                              {"type": "null"}]},
        "name": {"type": "string"}}}
CHAT_REQUEST = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "description": "one of GET /v1/models"},
        "messages": {"type": "array", "minItems": 1, "items": MESSAGE,
                     "description": "the conversation; the last one is the user's new "
                                    "message (docs/openai-api.md §Conversations)"},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"],
                           "properties": {"include_usage": {"type": ["boolean", "null"]}}},
        "n": {"type": ["integer", "null"], "minimum": 1},
        "tools": {"type": ["array", "null"], "items": {"type": "object"}},
        "functions": {"type": ["array", "null"], "items": {"type": "object"}},
        "metadata": {"type": ["object", "null"]},
    }}

USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {"prompt_tokens": {"type": "integer", "minimum": 0},
                        "completion_tokens": {"type": "integer", "minimum": 0},
                        "total_tokens": {"type": "integer", "minimum": 0}}}
_FINISH = {**FINISH_REASON, "type": ["string", "null"]}
CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string", "examples": ["chatcmpl-3f1c…"]},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer", "description": "Unix seconds"},
        "model": MODEL_ID,
        "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "required": ["index", "message", "finish_reason", "logprobs"],
            "properties": {
                "index": {"const": 0},
                "message": {"type": "object", "required": ["role", "content", "refusal"],
                            "properties": {"role": {"const": "assistant"},
                                           "content": {"type": "string"},
                                           "refusal": {"type": "null"},
                                           "annotations": {"type": "array",
                                                           "items": {"type": "object"}}}},
                "logprobs": {"type": "null"},
                "finish_reason": _FINISH}}},
        "usage": USAGE}}
CHUNK = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "description": "one `data:` frame of a streamed answer; the stream ends with "
                   "`data: [DONE]`",
    "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion.chunk"},
        "created": {"type": "integer"}, "model": MODEL_ID,
        "choices": {"type": "array", "maxItems": 1, "items": {
            "type": "object", "required": ["index", "delta", "logprobs", "finish_reason"],
            "properties": {"index": {"const": 0},
                           "delta": {"type": "object",
                                     "properties": {"role": {"const": "assistant"},
                                                    "content": {"type": "string"}}},
                           "logprobs": {"type": "null"}, "finish_reason": _FINISH}}},
        "usage": {"oneOf": [USAGE, {"type": "null"}]}}}
EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string", "description":
                "Server-Sent Events: `data: <ChatCompletionChunk JSON>` frames, then "
                "`data: [DONE]` (docs/openai-api.md §Streams)"}}}
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
         "properties": {"id": MODEL_ID, "object": {"const": "model"},
                        "created": {"type": "integer"}, "owned_by": {"type": "string"}}}
MODEL_LIST = {"type": "object", "required": ["object", "data"],
              "properties": {"object": {"const": "list"},
                             "data": {"type": "array", "items": MODEL}}}

SESSION_HEADER = "X-Hermes-Session-Id"
SESSION_ID = Param(SESSION_HEADER, "header", {"type": "string"},
                   "continue this conversation (an id this service returned to this user; "
                   "another user's or an unknown id: 404)")
#: response headers of the chat completions (components of /openapi.json)
RESPONSE_HEADERS = {SESSION_HEADER: {
    "description": "the conversation this answer belongs to: send it back to continue it "
                   "(docs/openai-api.md §Conversations)", "schema": {"type": "string"}}}

"""The shape of a chat request the model pass-through forwards, object by object
(hermes_service/model_proxy/request.py): what Hermes 0.19.0 sends passes; content parts, tools and
keys a provider would act on beyond answering text are refused with the path that holds them.
"""
from __future__ import annotations

import copy
import json

import pytest

from hermes_service.model_proxy.request import MAX_OUTPUT_TOKENS, Invalid, check

#: every kind of object Hermes 0.19.0 sends to a ``custom`` provider (recorded from real turns:
#: a tool-calling turn with reasoning; agent/prompt_caching.py's markers)
HERMES = {
    "model": "scripted-model", "max_tokens": 65536, "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [
        {"role": "system", "content": "You are Hermes.", "cache_control": {"type": "ephemeral"}},
        {"role": "user", "content": [{"type": "text", "text": "hi",
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "thinking",
         "reasoning_details": [{"type": "reasoning.text", "text": "t", "signature": None,
                                "index": 0}],
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "content": "{\"output\": \"a\"}", "tool_call_id": "call_1",
         "name": "terminal"},
        {"role": "assistant", "content": "done"},
    ],
    "tools": [{"type": "function", "function": {
        "name": "terminal", "description": "run", "strict": False,
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"], "anything": [[], {}]}}}],
    "tool_choice": "auto", "parallel_tool_calls": True, "temperature": 0.7, "top_p": 1,
    "stop": ["\n\n"], "seed": -5, "reasoning_effort": "high", "think": True,
    "reasoning": {"effort": "medium", "enabled": True, "exclude": False, "max_tokens": 2000},
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
}


def test_what_hermes_sends_passes():
    check(HERMES)
    check({"model": "m", "messages": [], "tool_choice": {"type": "function",
                                                         "function": {"name": "terminal"}}})


def at(path: str, value):
    """HERMES with ``value`` put at ``path`` (dots and [i])."""
    body = copy.deepcopy(HERMES)
    node, steps = body, path.replace("[", ".[").split(".")
    for step in steps[:-1]:
        node = node[int(step[1:-1])] if step.startswith("[") else node[step]
    last = steps[-1]
    if last.startswith("["):
        node[int(last[1:-1])] = value
    else:
        node[last] = value
    return body


@pytest.mark.parametrize("path, value, code, where", [
    # the provider would fetch an agent-chosen URL, or read the operator's files
    ("messages[1].content[0]", {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
     "unsupported_parameter", "messages[1].content[0].type"),
    ("messages[1].content[0]", {"type": "file", "file": {"file_id": "file-abc"}},
     "unsupported_parameter", "messages[1].content[0].type"),
    ("messages[1].content[0]", {"type": "input_audio", "input_audio": {"data": ""}},
     "unsupported_parameter", "messages[1].content[0].type"),
    ("messages[1].content[0].image_url", {"url": "https://x"}, "unsupported_parameter",
     "messages[1].content[0]"),
    # searches billed to the operator
    ("tools[0]", {"type": "web_search_preview"}, "unsupported_parameter", "tools[0].type"),
    ("tools[0]", {"type": "openrouter:web_search", "parameters": {"max_results": 50}},
     "unsupported_parameter", "tools[0].type"),
    ("tools[0].function.x", 1, "unsupported_parameter", "tools[0].function"),
    # keys Hermes never sends, at every level
    ("messages[1].x_smug", 3, "unsupported_parameter", "messages[1]"),
    ("messages[2].tool_calls[0].x", 1, "unsupported_parameter", "messages[2].tool_calls[0]"),
    ("messages[2].tool_calls[0].type", "code_interpreter", "unsupported_parameter",
     "messages[2].tool_calls[0].type"),
    ("messages[2].tool_calls[0].function.x", 1, "unsupported_parameter",
     "messages[2].tool_calls[0].function"),
    ("messages[0].role", "function", "unsupported_parameter", "messages[0].role"),
    ("messages[0].cache_control", {"type": "persistent"}, "invalid_request_body",
     "messages[0].cache_control.type"),
    ("stream_options", {"include_usage": True, "continuous_usage_stats": True},
     "unsupported_parameter", "stream_options"),
    ("reasoning", {"effort": "high", "x_smuggled": 2}, "unsupported_parameter", "reasoning"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "x": 1}},
     "unsupported_parameter", "response_format.json_schema"),
    # values: types and bounds
    ("max_tokens", 10 ** 30, "invalid_request_body", "max_tokens"),
    ("max_tokens", MAX_OUTPUT_TOKENS + 1, "invalid_request_body", "max_tokens"),
    ("max_tokens", 0, "invalid_request_body", "max_tokens"),
    ("max_tokens", True, "invalid_request_body", "max_tokens"),
    ("max_completion_tokens", 1.5, "invalid_request_body", "max_completion_tokens"),
    ("reasoning", {"max_tokens": 10 ** 9}, "invalid_request_body", "reasoning.max_tokens"),
    ("temperature", 1e308, "invalid_request_body", "temperature"),
    ("temperature", float("nan"), "invalid_request_body", "temperature"),
    ("top_p", -0.1, "invalid_request_body", "top_p"),
    ("seed", 2 ** 64, "invalid_request_body", "seed"),
    ("stop", ["a"] * 5, "invalid_request_body", "stop"),
    ("messages[4].content", 5, "invalid_request_body", "messages[4].content"),
    ("messages[3].tool_call_id", ["x"], "invalid_request_body", "messages[3].tool_call_id"),
    ("messages[1]", "hi", "invalid_request_body", "messages[1]"),
    ("messages[1]", {"content": "hi"}, "invalid_request_body", "messages[1]"),
    ("tools", {"type": "function"}, "invalid_request_body", "tools"),
    ("reasoning_effort", "maximum", "invalid_request_body", "reasoning_effort"),
])
def test_objects_hermes_does_not_send_are_refused_with_their_path(path, value, code, where):
    with pytest.raises(Invalid) as err:
        check(at(path, value))
    assert (err.value.code, err.value.path) == (code, where), err.value.message
    assert err.value.message.startswith(where + ": ")


def test_every_top_level_field_of_the_policy_has_a_rule():
    from hermes_service.model_proxy import policy as model_policy
    from hermes_service.model_proxy import request as model_request
    assert model_policy.CHAT_FIELDS == frozenset(model_request.CHAT_REQUEST_FIELDS)
    json.dumps(HERMES)

"""Scripted OpenAI-compatible model server: the test suite's model, and the demo's
(docs/testing.md §The scripted model: its endpoints, its directives, the auxiliary calls it
tells apart). Standard library only. The reply to each request is chosen by directives in the
last user message, so one server serves many concurrent tests.

* :mod:`.requests` — reading a request: messages, the last user turn, auxiliary calls, tools;
* :mod:`.plans` — the directives, read into a :class:`Plan`;
* :mod:`.server` — :class:`ScriptedModel`, the HTTP server answering as planned;
* :mod:`.hermes_home` — a Hermes home pointed at it, and the CLI's environment.

Usage::

    model = ScriptedModel("scripted-model").start()
    write_hermes_config(home, model.base_url, model.model_id, "SCRIPTED_API_KEY")
    env = hermes_env(home, "SCRIPTED_API_KEY")
    ...                       # run `hermes chat --query=... -Q --source tool`
    model.main_requests()     # main-turn request bodies seen so far
    model.stop()
"""
from .hermes_home import DEFAULT_HERMES_BIN, hermes_config, hermes_env, write_hermes_config
from .plans import REASONING_TEXT, Plan, plan_reply
from .requests import (
    AUX_REPLY,
    content_text,
    is_auxiliary,
    last_user_index,
    messages,
    offered_tools,
    parse_tool_directive,
)
from .server import ScriptedModel

__all__ = [
    "AUX_REPLY", "DEFAULT_HERMES_BIN", "REASONING_TEXT", "Plan", "ScriptedModel", "content_text",
    "hermes_config", "hermes_env", "is_auxiliary", "last_user_index", "messages",
    "offered_tools", "parse_tool_directive", "plan_reply", "write_hermes_config",
]

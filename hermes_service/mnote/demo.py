"""The demo provider: ``make demo`` / ``main.py --demo`` (README §Try it without a provider).

A stand-in model for a newcomer without a provider account: the test suite's scripted
OpenAI-compatible server (:mod:`hermes_service.scripted_model`, the one implementation) on
127.0.0.1, inside the service process, with a planner that needs no directives:

* every answer starts with :data:`LABEL` (``[demo model]``) and is streamed in pieces
  (about 3 s; a message mentioning ``long`` or ``slow``: about 30 s, time to abort it);
* a message mentioning ``append``, ``summary``/``summarize``, ``追加`` or ``总结`` makes it read
  the page (``mnote_page_get``) and append a paragraph to it (``mnote_page_save``, mode
  ``append``); one mentioning ``title`` or ``rename`` renames the page
  (``mnote_page_update_title``: the first text in double quotes, else :data:`DEMO_TITLE`) —
  only tools the request offers (mnote runs; the v1 API offers none);
* a message with the scripted model's directives (``[[...]]``) gets exactly what they say
  (``[[slow:S]]``, ``[[tools:NAME {json}]]``, ...), labelled too.

Only the user's own text counts: the page-context block the mnote client appends to the
message (:data:`~hermes_service.mnote.page_context.CONTEXT_HEAD`) is left out, so a page whose title
says "title" does not rename itself.

It is used only when asked for: :func:`overlay` (what ``--demo`` puts over the config file:
this model, ``hermes.runner: acp`` so answers stream, and the data dir's ``demo/``
sub-folder, so a demo never mixes with a real deployment's sessions, homes or pages) and
:func:`seed` (the walk-through's workspace ``ws_1``, editor ``user_1`` and
``examples/page.json``, put back at every demo start).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from .. import scripted_model as sm

#: How every answer of the demo model begins (and the model name it serves).
LABEL = "[demo model]"
MODEL_ID = "demo-model"
#: The title ``title``/``rename`` gives a page when the message quotes none.
DEMO_TITLE = "Renamed by the demo model"
#: The demo's sub-folder of the config's data dir.
DATA_SUBDIR = "demo"
EXAMPLE_PAGE = Path(__file__).resolve().parents[2] / "examples" / "page.json"
WORKSPACE, ACTOR = "ws_1", "user_1"

_APPEND_RE = re.compile(r"append|summar|追加|总结", re.I)
_TITLE_RE = re.compile(r"\btitle\b|\brename", re.I)
_LONG_RE = re.compile(r"\blong\b|\bslow\b", re.I)
_QUOTED_RE = re.compile(r'"([^"\n]*\S[^"\n]*)"')
_HINT = ('I am a scripted stand-in, not a real model. Mention "append" or "title" and I change '
         'the page with the mnote tools; "long" gives a slow answer you can abort.')


def _typed(body: dict) -> str:
    """What the user typed: the last user message without the mnote page-context block."""
    from .page_context import CONTEXT_HEAD
    msgs = sm.messages(body)
    i = sm.last_user_index(msgs)
    text = sm.content_text(msgs[i].get("content")) if i >= 0 else ""
    return text.split(CONTEXT_HEAD, 1)[0].strip()


def _page_summary(results: list[str]) -> str:
    """A sentence from ``mnote_page_get``'s result (title and first paragraph), if it has them."""
    try:
        found = json.loads(results[0]) if results else {}
    except ValueError:
        found = {}
    stack, title, first = [found], None, None
    while stack:                         # the page wherever the envelope puts it
        obj = stack.pop()
        if isinstance(obj, dict):
            if isinstance(obj.get("title"), str) and title is None:
                title = obj["title"]
            if obj.get("type") == "paragraph" and isinstance(obj.get("text"), str) \
                    and first is None:
                first = obj["text"]
            stack.extend(reversed(list(obj.values())))
        elif isinstance(obj, list):
            stack.extend(reversed(obj))
    parts = [p for p in (title and f"“{title}”", first) if p]
    return f"{LABEL} summary: " + (" — ".join(parts) if parts else "a page read by the demo model.")


def _calls(typed: str, offered: list[str], results: list[str]) -> list[tuple[str, dict]]:
    calls: list[tuple[str, dict]] = []
    if _APPEND_RE.search(typed) and {"mnote_page_get", "mnote_page_save"} <= set(offered):
        calls += [("mnote_page_get", {}),
                  ("mnote_page_save", {"mode": "append", "content": [
                      {"type": "paragraph", "text": _page_summary(results)}]})]
    if _TITLE_RE.search(typed) and "mnote_page_update_title" in offered:
        quoted = _QUOTED_RE.search(typed)
        calls.append(("mnote_page_update_title",
                      {"title": quoted.group(1).strip() if quoted else DEMO_TITLE}))
    return calls


def plan(body: dict, cut_done: set | None = None) -> sm.Plan:
    """The demo model's reply to one chat-completions request (the module doc's rules), as
    the scripted model's plan (:func:`~hermes_service.scripted_model.plan_reply`)."""
    if sm.is_auxiliary(body):            # session titles and other side calls
        out = sm.plan_reply(body, cut_done)
        out.text = "Demo conversation"
        return out
    typed = _typed(body)
    if "[[" in typed:                    # the scripted model's own directives
        out = sm.plan_reply(body, cut_done)
        if out.kind == "text":
            out.text = f"{LABEL} {out.text}"
        return out
    msgs = sm.messages(body)
    li = sm.last_user_index(msgs)
    results = [sm.content_text(m.get("content")) for m in msgs[li + 1:] if m.get("role") == "tool"]
    calls = _calls(typed, sm.offered_tools(body), results)
    pace = "[[slow:30:60]]" if _LONG_RE.search(typed) else "[[slow:3:12]]"
    directives = pace + ("[[tools:" + " ; ".join(f"{n} {json.dumps(a, ensure_ascii=False)}"
                                                for n, a in calls) + "]]" if calls else "")
    scripted = copy.deepcopy(body)
    sm.messages(scripted)[li]["content"] = directives
    out = sm.plan_reply(scripted, cut_done)
    if out.kind == "text":
        if calls:
            out.text = (f"{LABEL} Done: I called {', '.join(n for n, _ in calls)}; the page has "
                        "changed (main.py --demo mnote export-page doc_1 shows it).")
        else:
            out.text = f"{LABEL} You said: {typed or '(nothing)'}. {_HINT}"
    return out


def start_model() -> sm.ScriptedModel:
    """The demo model, serving on 127.0.0.1 (a free port) until ``stop()``."""
    return sm.ScriptedModel(MODEL_ID, planner=plan).start()


def overlay(base_url: str):
    """What ``--demo`` puts over the parsed config file (a function of the file's mapping):
    the demo model at ``base_url`` (no key), the ACP runner on every route family, and
    ``<paths.data_dir>/demo``."""
    def apply(data: dict | None) -> dict:
        data = copy.deepcopy(data) if isinstance(data, dict) else {}
        hermes = data.setdefault("hermes", {})
        model = hermes.setdefault("model", {}) if isinstance(hermes, dict) else {}
        if isinstance(model, dict):
            model.update(provider="custom", base_url=base_url, default=MODEL_ID, api_key_env=None)
        if isinstance(hermes, dict):
            hermes["runner"] = "acp"
        mnote = data.setdefault("mnote", {})
        if isinstance(mnote, dict):
            mnote["runner"] = "acp"
        paths = data.setdefault("paths", {})
        if isinstance(paths, dict):
            given = paths.get("data_dir")
            base = given if isinstance(given, str) else "data"
            paths["data_dir"] = str(Path(base) / DATA_SUBDIR)
        return data
    return apply


def seed(config) -> None:
    """The walk-through's page store: workspace ``ws_1`` ("Team"), ``user_1`` its editor, and
    ``examples/page.json`` (``doc_1``, overwritten: every demo starts from the example page)."""
    from .page_sqlite import SQLitePageStore
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = SQLitePageStore(config.data_dir / "mnote.db")
    store.add_workspace(WORKSPACE, "Team")
    store.add_member(WORKSPACE, ACTOR, "editor")
    store.import_page(json.loads(EXAMPLE_PAGE.read_text("utf-8")))


def warning(model: sm.ScriptedModel, config) -> str:
    """The start line saying a stand-in answers (logged at WARNING)."""
    return (f"demo: the demo model is answering, not a real provider: a scripted stand-in "
            f"({MODEL_ID} at {model.base_url}; answers start with {LABEL}); data dir "
            f"{config.data_dir}. For your provider: make run")

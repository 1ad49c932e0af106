"""The demo model's rules and overlay (hermes_service/mnote/demo.py; README "Try it without a
provider: make demo"), without Hermes: hand-written chat-completions requests to the real
demo model server. End to end (make demo, hermes acp, the walk-through): test_e2e_demo.py."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import requests

from hermes_service.installed import load_config
from hermes_service.mnote import demo
from hermes_service.mnote.page_context import CONTEXT_END, CONTEXT_HEAD
from support.fixtures import ROOT

TOOLS = ["mnote_page_get", "mnote_page_save", "mnote_page_update_title"]


@pytest.fixture(scope="module")
def model():
    server = demo.start_model()
    yield server
    server.stop()


def ask(model, text: str, tools=(), after=()) -> dict:
    body = {"model": demo.MODEL_ID, "scripted_main": True, "tools": [
        {"type": "function", "function": {"name": n}} for n in tools],
        "messages": [{"role": "user", "content": text}, *after]}
    return requests.post(model.base_url + "/chat/completions", json=body,
                         timeout=30).json()["choices"][0]["message"]


def call(message: dict) -> tuple[str, dict]:
    [tc] = message["tool_calls"]
    return tc["function"]["name"], json.loads(tc["function"]["arguments"])


def test_answers_are_labelled_and_say_what_the_demo_can_do(model):
    text = ask(model, "hello")["content"]
    assert text.startswith("[demo model] You said: hello.")
    assert '"append"' in text and '"title"' in text and '"long"' in text
    assert ask(model, "[[tools-offered]]", TOOLS[:1])["content"] == "[demo model] mnote_page_get"


def test_append_reads_the_page_then_appends_a_summary_of_it(model):
    assert call(ask(model, "追加一句总结", TOOLS)) == ("mnote_page_get", {})
    page = {"ok": True, "result": {"title": "项目计划", "blocks": [
        {"type": "heading", "text": "目标"}, {"type": "paragraph", "text": "第一段"}]}}
    step = [{"role": "assistant", "content": None}, {"role": "tool", "content": json.dumps(page)}]
    name, args = call(ask(model, "追加一句总结", TOOLS, step))
    assert name == "mnote_page_save" and args["mode"] == "append"
    assert args["content"] == [{"type": "paragraph", "text": "[demo model] summary: “项目计划” — 第一段"}]
    done = ask(model, "追加一句总结", TOOLS, step + step)["content"]
    assert done.startswith("[demo model] Done: I called mnote_page_get, mnote_page_save")


def test_title_renames_only_from_what_the_user_typed(model):
    assert call(ask(model, 'Rename it to "Q3 plan"', TOOLS)) == \
        ("mnote_page_update_title", {"title": "Q3 plan"})
    assert call(ask(model, "change the title", TOOLS))[1] == {"title": demo.DEMO_TITLE}
    # the page context the client appends names a title: it is not the user's request
    context = f"\n\n{CONTEXT_HEAD}\n" + json.dumps({"title": "append title"}) + CONTEXT_END
    assert ask(model, "hi" + context, TOOLS)["content"].startswith("[demo model] You said: hi.")
    # tools the request does not offer (v1 turns) are never called
    assert ask(model, "append a title")["content"].startswith("[demo model] You said:")


def test_the_overlay_swaps_model_runner_and_data_dir_only(tmp_path):
    (tmp_path / "config.yaml").write_text("security:\n  api_keys: [{key: a-test-key-0123456789}]\n"
                                         "paths:\n  data_dir: state\nhermes:\n  toolsets: [web]\n")
    config = load_config(tmp_path / "config.yaml", need_keys=False,
                         overlay=demo.overlay("http://127.0.0.1:5/v1"))
    model = config.hermes.model
    assert (model.base_url, model.default, model.api_key_env) == \
        ("http://127.0.0.1:5/v1", "demo-model", None)
    assert config.hermes.runner == "acp" and config.hermes.toolsets == ("web",)
    assert config.data_dir == tmp_path / "state" / "demo" and not config.provider_issues


def test_make_run_never_uses_the_demo():
    def recipe(target):
        # under `make test` this make is a sub-make: no "make[1]: Leaving directory" lines
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        dry = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "-o",
                              ".hermes-venv/.installed", "-o", "bubblewrap", target], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, env=env)
        assert dry.returncode == 0, dry.stderr
        return dry.stdout.strip().splitlines()[-1]
    assert recipe("run").endswith("exec .venv/bin/python main.py")
    assert recipe("demo").endswith("exec .venv/bin/python main.py --demo")

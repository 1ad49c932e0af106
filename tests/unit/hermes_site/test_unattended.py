"""A command Hermes flags where nobody can approve it (hermes_service/hermes_site/unattended.py;
docs/sandbox.md §What approvals are), in a real Hermes Python with the service's import hook:
refused at once with a text saying who refused — never "User denied" — or, with
``HERMES_YOLO_MODE=1`` (``unattended: run``), let through, the hard-line floor still blocking."""
from __future__ import annotations

import time

import pytest

from hermes_service.runner.processes import UNATTENDED_ENV, UNATTENDED_ROUTE_ENV

from .test_sitecustomize import hermes_python

GUARD = """
import json, time
import tools.approval as a
started = time.monotonic()
out = {{}}
for name, cmd in (("flagged", "python3 -c 'print(6*7)'"), ("hardline", "rm -rf ~"),
                  ("plain", "ls -la")):
    r = a.check_all_command_guards(cmd, "local")
    out[name] = {{"approved": r.get("approved"), "message": r.get("message")}}
out["seconds"] = time.monotonic() - started
print(json.dumps(out))
"""


def guard(tmp_path, **env):
    (tmp_path / ".hermes").mkdir(exist_ok=True)
    (tmp_path / ".hermes" / "config.yaml").write_text(
        "approvals:\n  mode: manual\n  timeout: 5\n")
    return hermes_python(GUARD.format(), tmp_path, env={"HERMES_INTERACTIVE": "1", **env})


def test_nobody_to_ask_refuses_at_once_and_says_who_refused(tmp_path):
    started = time.monotonic()
    out = guard(tmp_path, **{UNATTENDED_ENV: "deny", UNATTENDED_ROUTE_ENV: "the v1 API"})
    flagged = out["flagged"]
    assert flagged["approved"] is False
    assert "flagged by Hermes as dangerous (script execution via -e/-c flag)" in \
        flagged["message"]
    assert "no one can approve it on the v1 API" in flagged["message"]
    assert "User denied" not in flagged["message"]
    assert out["hardline"]["approved"] is False and out["plain"]["approved"] is True
    # no wait for a terminal nobody types in (the template's approvals.timeout is 5 s here)
    assert out["seconds"] < 4, out
    assert time.monotonic() - started < 60


def test_run_lets_flagged_commands_through_but_not_the_hard_line(tmp_path):
    out = guard(tmp_path, **{UNATTENDED_ENV: "run", "HERMES_YOLO_MODE": "1"})
    assert out["flagged"]["approved"] is True
    assert out["hardline"]["approved"] is False and "BLOCKED" in out["hardline"]["message"]


@pytest.mark.parametrize("description, route", [(None, None), ("x", "the v1 API")])
def test_the_refusal_text_names_the_key_and_the_route(description, route):
    from hermes_service.hermes_site.unattended import refusal
    text = refusal(description, route)
    assert text.startswith("BLOCKED: this command was flagged by Hermes as dangerous")
    assert (route or "this route") in text and "hermes.approvals.unattended" in text

"""Property-based fuzzing of the live service from its own OpenAPI document (docs/testing.md).

schemathesis (its CLI, pinned in requirements-dev.txt) reads ``GET /openapi.json`` of a real
service (``main.py``, waitress, the test config) and sends every operation bounded numbers of
generated requests — the schema's examples, boundary ("coverage") cases, undeclared methods
and random valid and invalid inputs, at most ``MAX_EXAMPLES`` per operation and phase, with a
fixed seed — with all its checks: it fails on any 5xx, on a status code the document does not
list for the operation, on a body, content type or header that does not match the documented
response (error codes included: each status's codes are an enum of its error body; every
Server-Sent Event's payload against ``RunEvent``), on invalid input accepted, on valid input
refused, on a missing required header or API key accepted, and on a 405 without ``Allow``.
:data:`SCHEMATHESIS_TOML` names the few documented exceptions, each with its reason.

Real CLI turns: a run started with valid input (``POST /api/hermes/client/runs``) runs the
real ``hermes`` CLI against the scripted model (hermes_service/scripted_model/), at most
``max_concurrent_runs`` at a time (more valid runs get the documented 429), and its event
stream is validated when the fuzzer reads it. v1 messages are kept to their validation paths
(the fuzzer never reuses a v1 session id it saw: 400/404), because a v1 turn blocks the
fuzzer for the CLI's ~4 s; ``/api/v1/execute`` runs its example. The tool endpoint gets the
run token of a run the scripted model keeps open (``[[hang]]``), so tool envelopes reach the
executor and the page store. The test prints requests, seconds and CLI processes per route.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_service.hermes_site import run_binding
from support.fixtures import API_KEY

pytestmark = pytest.mark.e2e    # real CLI turns (the hanging run, valid runs)

P = "/api/hermes/client"
TOOL_PATH = "/api/hermes/tools/invoke"
ACTOR = "fuzz_actor"
MAX_EXAMPLES = 20
SEED = 20261130
# the fuzz service: the CLI runner on the scripted model; one slot for the hanging run that
# lends its token to the tool endpoint, one for the fuzzer's runs
FUZZ_CONFIG = {
    "hermes": {"max_concurrent_runs": 2, "queue_wait_seconds": 5, "timeout_seconds": 900,
               "stall_timeout_seconds": 900},    # the hanging run lives through the fuzzing
    "mnote": {"events_retention_seconds": 900},
}
# schemathesis.toml of the run (docs/testing.md): what is checked, and the few documented
# exceptions, each with its reason
SCHEMATHESIS_TOML = """
seed = {seed}
request-timeout = 60
headers = {{ "X-API-Key" = "{api_key}" }}

[generation]
max-examples = {max_examples}
mode = "all"

[phases.stateful]
enabled = false

# values that let generated requests past the 404s/403s into the routes' logic: the seeded
# member actor and page, and (tool endpoint) the ids of the hanging run whose token is sent
[dictionaries.actor]
values = ["{actor}"]
[dictionaries.workspace]
values = ["ws_1"]
[dictionaries.document]
values = ["doc_1"]
[dictionaries.run]
values = ["{run_id}"]
[dictionaries.session]
values = ["{session_id}"]
[dictionaries.tool]
values = {tool_names}

[[operations]]
include-path-regex = "^/api/hermes/client/"
parameters = {{ "header.X-Mnote-Actor-Id" = {{ dictionary = "actor", probability = 0.5 }}, \
"body.workspaceId" = {{ dictionary = "workspace", probability = 0.5 }}, \
"body.documentId" = {{ dictionary = "document", probability = 0.5 }} }}

[[operations]]
include-path = "{tool_path}"
headers = {{ "Authorization" = "Bearer {token}" }}
parameters = {{ "body.actorId" = {{ dictionary = "actor", probability = 0.7 }}, \
"body.runId" = {{ dictionary = "run", probability = 0.8 }}, \
"body.sessionId" = {{ dictionary = "session", probability = 0.8 }}, \
"body.workspaceId" = {{ dictionary = "workspace", probability = 0.7 }}, \
"body.documentId" = {{ dictionary = "document", probability = 0.7 }}, \
"body.toolName" = {{ dictionary = "tool", probability = 0.7 }} }}
# contract §3: an envelope the executor refuses (schema, unknown tool, …) is still an executed
# call, answered HTTP 200 with ok: false and the code - not a 4xx
checks.negative_data_rejection.enabled = false

[[operations]]
include-path = "/api/v1/sessions/{{session_id}}/messages"
# validation paths only: a v1 turn answers when the CLI has (~4-5 s, serially); never reuse a
# session id a response showed, so the session is unknown (404) or the input invalid (400)
phases.coverage.extra-data-sources.responses = false
phases.fuzzing.extra-data-sources.responses = false

[[operations]]
include-path = "/api/v1/execute"
# the caller chooses the time limit: one of at least the minimum (1 s; less is 400) but
# shorter than the CLI's start-up (~3 s) is answered with the documented 504 run_timeout, the
# command's own outcome
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "504"]

[[operations]]
include-path = "/api/hermes/client/events/{{run_id}}"
# a Last-Event-ID above the run's last id (never issued) is 400 (docs/mnote-client.md §Event ids and reconnects): the
# document cannot tell which ids a run has issued, so any integer is schema-valid
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]
# an unknown header or query parameter is not invalid input (HTTP: what a server does not
# know it ignores); a run id seen in an earlier response makes such a request a 200 stream
generation.allow-extra-parameters = false

[[operations]]
include-path = "/api/ai-agent/run"
# contract §4: the retired legacy endpoint answers 410 to everything, valid input included
checks.positive_data_acceptance.enabled = false
"""


def _hanging_run(svc) -> dict:
    """Start a run whose model never answers; return its run binding (ids and run token).

    The binding lies in no file (docs/mnote-tools.md §Run binding): it reaches the CLI turn's
    Hermes in its environment, which this test reads back from ``/proc`` as root (a user's
    own processes cannot: Hermes is non-dumpable)."""
    if os.geteuid() != 0:
        pytest.skip("reading a run token out of Hermes's environment needs root")
    res = svc.post(f"{P}/runs", headers={"X-API-Key": API_KEY, "X-Mnote-Actor-Id": ACTOR},
                   json={"workspaceId": "ws_1", "documentId": "doc_1", "message": "[[hang]]",
                         "sessionId": "mnote_doc_1_hang"})
    assert res.status_code == 200, res.text
    prefix = (run_binding.ENV + "=").encode()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                entries = environ.read_bytes().split(b"\0")
            except OSError:
                continue
            for entry in entries:
                if entry.startswith(prefix):
                    binding = run_binding.decode(entry[len(prefix):].decode("ascii", "replace"))
                    if binding and binding.get("runId") == res.json()["runId"]:
                        return binding
        time.sleep(0.1)
    pytest.fail("the hanging run's Hermes never started with its run binding")


@pytest.fixture
def fuzz_target(start_service):
    svc = start_service(FUZZ_CONFIG)
    from e2e.test_e2e_tools import mnote_cli
    mnote_cli(svc, "add-workspace", "ws_1")
    mnote_cli(svc, "add-member", "ws_1", ACTOR, "editor")
    mnote_cli(svc, "import-page", "-", stdin=json.dumps({
        "documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
        "blocks": [{"id": "b1", "type": "paragraph", "text": "第一段"}]}))
    return svc, _hanging_run(svc)


def _print_costs(log: str) -> None:
    """Requests and CLI processes per route (the fuzz budget), and any error the service logged."""
    table: dict[str, list] = {}
    for line in log.splitlines():
        m = re.search(r" route=(\S+) status=\S+ ms=([0-9.]+)", line)
        if m:
            row = table.setdefault(m[1], [0, 0.0, 0])
            if "hermes_service.access" in line:
                row[0] += 1
                row[1] += float(m[2])
            elif "hermes_service.runner" in line:
                row[2] += 1
        if "Traceback" in line or " ERROR " in line:
            print("service:", line[:300])
    for route, (n, ms, cli) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        print(f"{route:58} {n:5} requests {ms / 1000:7.1f} s  {cli:3} CLI processes")


def test_fuzz_every_operation(fuzz_target, tmp_path):
    svc, hanging = fuzz_target
    from hermes_service.mnote.tools import TOOLS
    toml = tmp_path / "schemathesis.toml"
    toml.write_text(SCHEMATHESIS_TOML.format(
        seed=SEED, max_examples=MAX_EXAMPLES, api_key=API_KEY, tool_path=TOOL_PATH, actor=ACTOR,
        token=hanging["runToken"], run_id=hanging["runId"], session_id=hanging["sessionId"],
        tool_names=json.dumps([t.name for t in TOOLS])))
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(toml), "--no-color",
         "run", svc.url + "/openapi.json", "--url", svc.url, "--workers", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    print(res.stdout[-30000:], res.stderr[-5000:])
    print(f"fuzzing took {time.monotonic() - started:.0f} s")
    _print_costs(svc.log_through(svc.get("/health")))
    assert res.returncode == 0, "schemathesis found problems (output above)"

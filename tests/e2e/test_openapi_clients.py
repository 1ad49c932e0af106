"""Clients generated from the API description (docs/api-description.md §Generating a client).

``/openapi.json`` must give client developers what they would otherwise hand-write: a complete
Python client from openapi-python-client (every route; every error response a model with its
codes as an enum) and TypeScript types from openapi-typescript (they compile, and a run event
narrows by its ``event``). Both generators are pinned and installed by ``make setup``
(``.tools-venv``, ``tools/node_modules``); a test whose generator is missing skips and says
so. The generated code is written to a temporary folder, never to the repository.

The e2e test then drives a real service (waitress, the real ``hermes`` on the scripted model)
with the generated Python client — the v1 flow and the panel flow — in
``tests/support/generated_client_flows.py``, run with ``.tools-venv``'s Python (where httpx and attrs,
the generated client's dependencies, are).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from support.fixtures import API_KEY, ROOT, base_config

TOOLS_VENV = ROOT / ".tools-venv" / "bin"
PYTHON_GENERATOR = TOOLS_VENV / "openapi-python-client"
NODE_BIN = ROOT / "tools" / "node_modules" / ".bin"
TS_GENERATOR = NODE_BIN / "openapi-typescript"
TSC = NODE_BIN / "tsc"
PACKAGE = "hermes_service_client"
FLOWS = Path(__file__).parents[1] / "support" / "generated_client_flows.py"


def _require(tool: Path, what: str) -> None:
    if not os.access(tool, os.X_OK):
        pytest.skip(f"{tool.relative_to(ROOT)} is missing: make setup installs {what}")


@pytest.fixture(scope="module")
def document(tmp_path_factory) -> dict:
    """The test config's /openapi.json (the services started below serve the same)."""
    from hermes_service import create_app
    from hermes_service.installed import build_config
    app = create_app(build_config(base_config(tmp_path_factory.mktemp("doc"))))
    res = app.test_client().get("/openapi.json", headers={"X-API-Key": API_KEY})
    assert res.status_code == 200
    return res.json


@pytest.fixture(scope="module")
def python_client(document, tmp_path_factory):
    """openapi-python-client's package for ``document``: (folder holding it, its output)."""
    _require(PYTHON_GENERATOR, "openapi-python-client into .tools-venv")
    where = tmp_path_factory.mktemp("python-client")
    (where / "openapi.json").write_text(json.dumps(document))
    # as docs/api-description.md's command: the venv first on PATH, for the ruff the generator formats with
    env = {**os.environ, "PATH": f"{TOOLS_VENV}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run([str(PYTHON_GENERATOR), "generate", "--path", "openapi.json",
                          "--meta", "none", "--output-path", PACKAGE, "--fail-on-warning"],
                         cwd=where, env=env, capture_output=True, text=True, timeout=300)
    output = res.stdout + res.stderr
    assert res.returncode == 0, output
    return where, output


def _operations(document):
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            yield path, method, op


def test_python_client_has_every_route_and_typed_errors(document, python_client):
    where, output = python_client
    # the generator's warnings name what it skipped ("Endpoint will not be generated",
    # "response will be omitted"); --fail-on-warning made any of them fail above, and:
    assert "WARNING" not in output and "ruff is not in PATH" not in output, output
    api = where / PACKAGE / "api"
    generated = {p.stem: p.read_text() for p in api.rglob("*.py") if p.stem != "__init__"}
    ops = list(_operations(document))
    assert sorted(generated) == sorted(op["operationId"] for _, _, op in ops)
    for path, method, op in ops:
        code = generated[op["operationId"]]
        for status, response in op["responses"].items():
            media = response.get("content", {})
            if "application/json" in media:
                # the status is parsed into a generated model (the error body and its codes)
                assert re.search(rf"status_code == {status}:\s+response_{status} = "
                                 r"\w+\.from_dict\(response\.json\(\)\)", code), \
                    f"{method} {path} {status}: no model"
            elif "text/event-stream" in media:
                assert "RunEventFrame.from_dict" in code, f"{method} {path}: no event model"
    # each error status's codes are the enum of its model: the code a test meets is typed
    enum = (where / PACKAGE / "models" / "api_v1_execute_response_400_code.py").read_text()
    assert 'INVALID_REQUEST = "invalid_request"' in enum
    models = (where / PACKAGE / "models" / "__init__.py").read_text()
    events = [r["$ref"].rsplit("/", 1)[1]
              for r in document["components"]["schemas"]["RunEvent"]["oneOf"]]
    for name in ["RunEventFrame", "ToolEnvelope", "ToolFailure", "ClientError", "V1Error",
                 *events]:
        assert re.search(rf"^from \.\w+ import {name}$", models, re.M), name


#: a TypeScript client's use of the generated types: tsc must accept it (strict)
TS_USAGE = """\
import type { components, paths } from "./api";

type RunEvent = components["schemas"]["RunEvent"];
type Frame = components["schemas"]["RunEventFrame"];
type Events = paths["/api/hermes/client/events/{run_id}"]["get"];
type Stream = Events["responses"][200]["content"]["text/event-stream"];
type NotFound = Events["responses"][404]["content"]["application/json"];
type ExecuteBody = paths["/api/v1/execute"]["post"]["requestBody"]["content"]["application/json"];
type ToolDenied = paths["/api/hermes/tools/invoke"]["post"]["responses"][403]["content"]["application/json"];

export function answer(frame: Frame): string | null {
  const event = JSON.parse(frame.data) as RunEvent;
  switch (event.event) {             // narrowed by the event's name
    case "run.completed": return event.output;
    case "run.failed": return event.code;
    case "approval.request": return event.approval_id;
    default: return null;
  }
}
export const frame = (body: Stream): Frame | null => (typeof body === "string" ? null : body);
export const notFound = (e: NotFound): "hermes_client_not_found" => e.code;
export const execute: ExecuteBody = { command: ["version"], timeout: 1 };
export const denied = (e: ToolDenied): "mnote_tool_unauthorized" | "mnote_tool_permission_denied" =>
  e.error.code;
"""
TSCONFIG = {"compilerOptions": {"strict": True, "noEmit": True, "target": "es2022",
                                "module": "es2022", "moduleResolution": "bundler",
                                "types": []},
            "files": ["usage.ts"]}


def test_typescript_types_cover_every_route_and_compile(document, tmp_path):
    _require(TS_GENERATOR, "openapi-typescript into tools/node_modules")
    (tmp_path / "openapi.json").write_text(json.dumps(document))
    res = subprocess.run([str(TS_GENERATOR), "openapi.json", "-o", "api.d.ts"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    output = res.stdout + res.stderr
    assert res.returncode == 0, output
    assert not re.search(r"warn|error|⚠", output, re.I), output
    types = (tmp_path / "api.d.ts").read_text()
    for path, _method, op in _operations(document):
        assert f'    "{path}": {{' in types, path
        assert re.search(rf"\b{op['operationId']}: {{", types), op["operationId"]
    (tmp_path / "usage.ts").write_text(TS_USAGE)
    (tmp_path / "tsconfig.json").write_text(json.dumps(TSCONFIG))
    res = subprocess.run([str(TSC), "-p", "tsconfig.json"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.e2e    # real CLI turns: a v1 message, a panel run, a run aborted
def test_generated_python_client_drives_the_v1_and_panel_flows(start_service, document,
                                                               python_client):
    svc = start_service()
    # the client was generated from the document this service serves
    assert svc.get("/openapi.json").json() == document
    where, _ = python_client
    res = subprocess.run([str(TOOLS_VENV / "python"), str(FLOWS), str(where), PACKAGE, svc.url,
                          API_KEY, "v1,panel"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr + svc.log()[-3000:]
    seen = json.loads(res.stdout.splitlines()[-1])

    v1 = seen["v1"]
    assert v1["answer"] == "echo #1: hello from the client" and v1["resumed"] is False
    assert v1["message_count"] == 1 and v1["user_id"] == "client_user"
    assert v1["missing_code"] == "session_not_found"
    # a timeout too small to start a process: 400 naming the minimum (docs/v1-api.md)
    assert v1["too_short_code"] == "invalid_request"
    assert v1["too_short_detail"] == "timeout: 5e-324 is less than the minimum of 1"

    panel = seen["panel"]
    assert panel["session_id"] == "mnote_doc_1_client_1"
    answered = panel["answered"]
    assert [name for _, name, _ in answered] == ["RunStartedEvent", "MessageDeltaEvent",
                                                 "RunCompletedEvent"]
    assert [i for i, _, _ in answered] == ["1", "2", "3"]
    assert answered[-1][2].startswith("echo #1: panel question")
    assert [role for role, _ in panel["transcript"]] == ["user", "assistant"]
    assert panel["transcript"][0][1] == "panel question"
    assert panel["abort_events"] == ["AbortStartedEvent"]
    assert panel["cancelled"][-2:] == ["AbortStartedEvent", "RunCancelledEvent"]
    assert panel["unknown_code"] == "hermes_client_not_found"

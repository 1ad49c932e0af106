"""The v1 flow and the panel flow, driven with the Python client openapi-python-client
generated from the service's ``/openapi.json`` (docs/api-description.md §Generating a client).

Run by ``tests/e2e/test_openapi_clients.py`` with ``.tools-venv``'s Python (it has httpx and attrs,
what a generated client runs on; neither the service nor its test venv is imported here):

    python generated_client_flows.py <dir holding the package> <package> <base url> <api key> <flow>

``flow`` is ``v1``, ``panel`` or both (``v1,panel``). Only the generated package talks to the service; each answer
must parse into the generated model of its status (a success model, or the error model whose
``code`` enum lists the code). Prints one JSON object of what was seen, for the test to check.
"""
from __future__ import annotations

import importlib
import json
import sys

ACTOR = "client_actor"


def expect(response, status: int, model: str):
    """The parsed answer of a generated ``sync_detailed`` call: HTTP ``status`` and an instance
    of the generated class ``model``."""
    parsed = response.parsed
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert type(parsed).__name__ == model, (type(parsed).__name__, model)
    return parsed


def v1_flow(pkg, client) -> dict:
    """Create a session, send a message (a real CLI turn), read the session back; plus the
    typed errors of an unknown session and of a too small execute timeout."""
    api = importlib.import_module(f"{pkg.__name__}.api.v1")
    models = pkg.models
    load = lambda name: importlib.import_module(f"{api.__name__}.{name}")  # noqa: E731
    created = expect(load("api_v1_create_session").sync_detailed(
        client=client, body=models.ApiV1CreateSessionBody(user_id="client_user")),
        200, "ApiV1CreateSessionResponse200")
    sid = created.session_id
    reply = expect(load("api_v1_send_message").sync_detailed(
        sid, client=client, body=models.ApiV1SendMessageBody(message="hello from the client")),
        200, "ApiV1SendMessageResponse200")
    info = expect(load("api_v1_get_session").sync_detailed(sid, client=client),
                  200, "ApiV1GetSessionResponse200")
    missing = expect(load("api_v1_get_session").sync_detailed("no_such_session", client=client),
                     404, "ApiV1GetSessionResponse404")
    too_short = expect(load("api_v1_execute").sync_detailed(
        client=client, body=models.ApiV1ExecuteBody(command=["version"], timeout=5e-324)),
        400, "ApiV1ExecuteResponse400")
    return {"session_id": sid, "answer": reply.response, "resumed": reply.resumed,
            "message_count": info.message_count, "user_id": info.user_id,
            "missing_code": missing.code.value, "too_short_code": too_short.code.value,
            "too_short_detail": too_short.detail}


def frames(text: str, pkg) -> list:
    """The generated ``RunEventFrame``s of a stream read whole (the events route answers the
    text), each with its ``data`` parsed into the generated model of its event."""
    def model(event: str):          # run.started → RunStartedEvent (the document's names)
        return getattr(pkg.models, "".join(p.capitalize() for p in event.split(".")) + "Event")

    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines()
                      if line and not line.startswith(":"))
        if not fields:
            continue
        frame = pkg.models.RunEventFrame.from_dict(fields)
        data = json.loads(frame.data)
        event = model(data["event"]).from_dict(data)
        out.append((frame.id, event))
    return out


def panel_flow(pkg, client) -> dict:
    """Create a session, start a run and read its events to the end, read the transcript; then
    a run the model keeps open, abort it, read its events; plus a typed client error."""
    models = pkg.models
    load = lambda name: importlib.import_module(f"{pkg.__name__}.api.client.{name}")  # noqa: E731
    actor = {"x_mnote_actor_id": ACTOR}
    created = expect(load("mnote_client_create_session").sync_detailed(
        client=client, body=models.MnoteClientCreateSessionBody(
            workspace_id="ws_1", document_id="doc_1", trace_id="client_1", title="panel"),
        **actor), 200, "MnoteClientCreateSessionResponse200")
    sid = created.session_id

    def run(message: str):
        body = models.MnoteClientStartRunBody(
            workspace_id="ws_1", document_id="doc_1", session_id=sid, message=message,
            model=models.MnoteClientStartRunBodyModelType1("hermes-agent"),
            page_context=models.MnoteClientStartRunBodyPageContextType0(title="项目计划",
                                                                        outline=[]))
        return expect(load("mnote_client_start_run").sync_detailed(client=client, body=body,
                                                                   **actor),
                      200, "MnoteClientStartRunResponse200").run_id

    def events(run_id: str) -> list:
        res = load("mnote_client_events").sync_detailed(run_id, client=client, **actor)
        assert res.status_code == 200 and isinstance(res.parsed, str), res.status_code
        return frames(res.parsed, pkg)

    answered = events(run("panel question"))
    transcript = expect(load("mnote_client_get_session").sync_detailed(
        sid, client=client, workspace_id="ws_1", document_id="doc_1", **actor),
        200, "MnoteClientGetSessionResponse200")

    hanging = run("[[hang]]")
    aborted = expect(load("mnote_client_abort").sync_detailed(
        hanging, client=client, body=models.MnoteClientAbortBody(session_id=sid), **actor),
        200, "MnoteClientAbortResponse200")
    cancelled = events(hanging)
    unknown = expect(load("mnote_client_events").sync_detailed(
        "run_unknown", client=client, **actor), 404, "MnoteClientEventsResponse404")
    return {
        "session_id": sid,
        "answered": [(i, type(e).__name__, getattr(e, "output", None)) for i, e in answered],
        "transcript": [(m.role, m.content) for m in transcript.messages],
        "abort_events": [type(e).__name__ for e in aborted.events],
        "cancelled": [type(e).__name__ for _, e in cancelled],
        "unknown_code": unknown.code.value,
    }


def main(where: str, package: str, url: str, key: str, flow: str) -> None:
    sys.path.insert(0, where)
    pkg = importlib.import_module(package)
    importlib.import_module(f"{package}.models")
    import httpx
    client = pkg.AuthenticatedClient(base_url=url, token=key, prefix="",
                                     auth_header_name="X-API-Key",
                                     timeout=httpx.Timeout(120.0),
                                     raise_on_unexpected_status=True)
    flows = {"v1": v1_flow, "panel": panel_flow}
    with client:
        seen = {name: flows[name](pkg, client) for name in flow.split(",")}
    print(json.dumps(seen, ensure_ascii=False))


if __name__ == "__main__":
    main(*sys.argv[1:])

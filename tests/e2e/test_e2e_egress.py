"""No unexpected outbound traffic, through the real service and the real CLI.

The admin routes provider traffic through an HTTP proxy (``HTTP_PROXY``/``HTTPS_PROXY`` in
``hermes.extra_env``); a small recording proxy (tests/support/recording_proxy.py) sees every target a
turn asks for. The provider call goes service → proxy → provider: Hermes calls the service's
model pass-through on loopback directly (the service puts 127.0.0.1 in the Hermes process's
``NO_PROXY``, hermes_service/homes/users.py), and the pass-through sends it on through the
proxy named in ``extra_env`` (hermes_service/model_proxy/upstream.py, ``upstream_proxy_for``) with the
real key. Only the provider may appear at the proxy, and only with the real key, never a
per-process credential: no update check against the package index, no mnote tool call (the
plugin calls the service's loopback URL directly, so the run token never reaches a proxy), no
call to the pass-through itself.
"""
import json
from urllib.parse import urlsplit

import pytest

from hermes_service.mnote.page_sqlite import SQLitePageStore
from support.fixtures import API_KEY, PROVIDER_KEY_ENV
from support.recording_proxy import RecordingProxy
from support.sse_client import read_all

pytestmark = pytest.mark.e2e

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_a"}


def test_a_turn_talks_to_the_provider_only_and_tool_calls_skip_the_proxy(start_service, model,
                                                                         tmp_path):
    store = SQLitePageStore(tmp_path / "data" / "mnote.db")
    store.add_workspace("ws_1")
    store.add_member("ws_1", "user_a", "editor")
    store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "egress page"})
    store.close()
    with RecordingProxy() as proxy:
        proxies = {name: proxy.url for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                "https_proxy", "ALL_PROXY")}
        svc = start_service({"hermes": {"extra_env": proxies}})
        res = svc.post(f"{P}/runs", headers=A, json={
            "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_egress",
            "message": "[[tools:mnote_page_get {}]] egress"})
        assert res.status_code == 200, res.text
        events = [d for _, d in read_all(svc.url + f"{P}/events/{res.json()['runId']}", A)]
    assert events[-1]["event"] == "run.completed", events
    [result] = [json.loads(p) for p in events[-1]["output"][len("tools done: "):].split(" || ")]
    assert result["ok"] is True and result["result"]["title"] == "egress page"
    assert [e["ok"] for e in events if e["event"] == "tool.completed"] == [True]
    provider = urlsplit(model.base_url).netloc
    assert ("POST", provider) in proxy.seen            # the proxy really carried the turn
    assert proxy.targets() == {provider}, proxy.seen   # nothing else: no pypi, no tool URL
    # sent by the service's pass-through (the real key), not by Hermes (its credential)
    auths = {fields.get("authorization") for _, _, fields in proxy.requests}
    assert auths == {f"Bearer {svc.env[PROVIDER_KEY_ENV]}"}, auths

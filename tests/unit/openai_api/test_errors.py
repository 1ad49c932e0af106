"""Every error status of the OpenAI-compatible routes is the ``openai`` SDK's exception class
(docs/openai-api.md §Errors): the SDK talks to the in-process app through httpx's WSGI
transport, the CLI runner stubbed at its seam (the real service: tests/e2e/test_e2e_openai.py)."""
import httpx
import openai
import pytest

from hermes_service.runner import Outcome
from support.fixtures import PROVIDER_KEY_ENV

KEY = "openai-key-0123456789abcdef"
CFG = {"openai": {"runner": "cli"},
       "security": {"api_keys": [{"key": KEY, "user_id": "alice", "scopes": ["openai"]}]}}


def sdk(app) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://openai.test/v1", api_key=KEY, max_retries=0,
                         http_client=httpx.Client(transport=httpx.WSGITransport(app=app)))


def ask(client):
    return client.chat.completions.create(model="hermes",
                                          messages=[{"role": "user", "content": "hi"}])


def test_an_answer_through_the_sdk(stubbed_app):
    assert ask(sdk(stubbed_app(CFG))).choices[0].message.content == "echo #1: hi"


def test_no_provider_is_503(stubbed_app, monkeypatch, stub):
    monkeypatch.delenv(PROVIDER_KEY_ENV)
    with pytest.raises(openai.InternalServerError) as caught:
        ask(sdk(stubbed_app(CFG)))
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "hermes_unconfigured"
    assert caught.value.body["type"] == "service_unavailable_error"
    assert stub.calls == []


def test_a_turn_over_its_time_is_504(stubbed_app, stub):
    stub.outcomes = [Outcome(-9, "", "", 120.0, killed="timeout")]
    with pytest.raises(openai.InternalServerError) as caught:
        ask(sdk(stubbed_app(CFG)))
    assert caught.value.status_code == 504 and caught.value.body["code"] == "run_timeout"


def test_a_failed_turn_is_502(stubbed_app, stub):
    stub.outcomes = [Outcome(1, "", "boom", 0.1)]
    with pytest.raises(openai.InternalServerError) as caught:
        ask(sdk(stubbed_app(CFG)))
    assert caught.value.status_code == 502


def test_a_draining_service_is_503_with_retry_after(stubbed_app):
    app = stubbed_app(CFG)
    app.extensions["hermes_service"].processes.draining = True
    with pytest.raises(openai.InternalServerError) as caught:
        ask(sdk(app))
    assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"]


@pytest.mark.parametrize("path", ["/v1/nothing", "/v1/models/x/y"])
def test_an_unknown_route_under_v1_is_404_in_openai_shape(stubbed_app, path):
    res = stubbed_app(CFG).test_client().get(path, headers={"Authorization": f"Bearer {KEY}"})
    assert res.status_code == 404 and set(res.json["error"]) == {"message", "type", "code",
                                                                 "param"}

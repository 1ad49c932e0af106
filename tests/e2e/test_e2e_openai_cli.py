"""The OpenAI-compatible routes on the CLI runner (``openai.runner: cli``: one ``hermes chat``
per turn in the user's sandbox) through the official ``openai`` SDK: a whole answer, a stream
whose answer arrives in one chunk at the end, and a client that goes away — streamed or not —
ending the turn's process (docs/openai-api.md). One service for the module."""
import socket
import time

import openai
import pytest

from support.fixtures import ServiceProcess, base_config, deep_merge, wait_for
from support.openai_attacks import inflated_turn

pytestmark = pytest.mark.e2e

KEY = "cli-key-0123456789abcdef"


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("openai-cli")
    cfg = deep_merge(base_config(tmp, model.base_url), {
        "openai": {"runner": "cli"},
        "security": {"api_keys": [{"key": KEY, "user_id": "clara", "scopes": ["openai"]}]}})
    service = ServiceProcess(tmp, cfg).start()
    yield service
    service.stop()


def sdk(svc) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=180)


def user(text):
    return {"role": "user", "content": text}


def test_answers_and_a_stream_of_one_piece(svc):
    client = sdk(svc)
    done = client.chat.completions.create(model="hermes", messages=[user("cli hello")])
    assert done.choices[0].message.content == "echo #1: cli hello"
    assert done.usage.total_tokens > 0
    chunks = list(client.chat.completions.create(
        model="hermes", messages=[user("cli stream")], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:-2]] == ["echo #1: cli stream"]
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.total_tokens > 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_ends_the_turns_process(svc, model, stream):
    marker = f"[[hang]] gone {stream}"
    killed_before = svc.log().count("killed=cancelled")
    body = ('{"model": "hermes", "stream": %s, "messages": [{"role": "user", "content": '
            '"%s"}]}' % ("true" if stream else "false", marker)).encode()
    sock = socket.create_connection(("127.0.0.1", svc.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 90
    while not model.requests_with(marker):           # the turn's hermes chat asks the model
        assert time.monotonic() < deadline, svc.log()[-3000:]
        time.sleep(0.2)
    sock.close()                                     # the client goes away
    # the process group was killed and reaped: nothing of the turn is left running
    wait_for(lambda: svc.log().count("killed=cancelled") > killed_before,
             "the turn's hermes chat killed (killed=cancelled)", 60, log=svc.log)
    assert "the client went away; stopping the turn" in svc.log()


def test_an_agent_that_inflates_its_token_counters_is_capped(svc, model):
    usage = inflated_turn(sdk(svc), model, svc.data_dir / "users" / "clara", "oacounterscli")
    assert 0 < usage.total_tokens < 100000

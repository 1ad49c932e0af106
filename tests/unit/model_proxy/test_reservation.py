"""What a request holds of a user's daily budget while it runs (hermes_service/model_proxy/
proxy.py ``ModelProxy.reserve``, policy.py ``Prepared.max_output``; docs/sandbox.md
§Model pass-through): its prompt estimate plus the output it asks for —
``max_completion_tokens`` (OpenAI's current name) or ``max_tokens`` — and, when it names
neither, :data:`~hermes_service.model_proxy.limits.RESERVE_OUTPUT_TOKENS`: never nothing.
Read through the public seam: whether another request of the user still fits."""
from __future__ import annotations

import json

import pytest

from hermes_service.model_proxy import limits
from hermes_service.model_proxy.policy import Policy, Prepared, Refusal
from hermes_service.model_proxy.proxy import ModelProxy
from hermes_service.model_proxy.usage import usage_db_path

POLICY = Policy(frozenset({"m"}), 1 << 20)


def prepared(**fields) -> Prepared:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()
    return POLICY.prepare_chat(body, "application/json")


@pytest.mark.parametrize(("fields", "asked"), [
    ({"max_completion_tokens": 100}, 100), ({"max_tokens": 200}, 200),
    ({"max_completion_tokens": 100, "max_tokens": 9000}, 100), ({}, None)])
def test_the_output_a_request_asks_for_is_read_from_either_name(fields, asked):
    assert prepared(**fields).max_output == asked


@pytest.fixture
def proxy(tmp_path):
    def make(budget):
        return ModelProxy("http://127.0.0.1:9/v1", None, usage_db_path(tmp_path / "data"),
                          models={"m"}, daily_tokens=budget)
    return make


def fits(proxy: ModelProxy, user: str) -> bool:
    try:
        proxy.check_budget(user)
    except Refusal as refused:
        assert refused.code == "token_budget_exceeded"
        return False
    return True


def test_a_request_holds_its_prompt_and_the_output_it_names(proxy):
    p = prepared(max_completion_tokens=100)
    need = p.prompt_estimate + 100
    tight, loose = proxy(need), proxy(need + 1)
    with loose.reserve("u", p):
        assert fits(loose, "u")                  # need < budget: another may start
    with tight.reserve("u", p):
        assert not fits(tight, "u")              # need == budget: nothing more
    assert fits(tight, "u")                      # given back at the end


def test_a_request_naming_no_output_holds_the_default_reserve(proxy):
    p = prepared()
    budget = proxy(p.prompt_estimate + limits.RESERVE_OUTPUT_TOKENS)
    with budget.reserve("u", p):
        assert not fits(budget, "u")
        assert fits(budget, "other user")


def test_without_a_budget_nothing_is_held(proxy):
    free = proxy(None)
    with free.reserve("u", prepared()):
        assert fits(free, "u")

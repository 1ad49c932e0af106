"""Bounding what a hostile JSON text costs before it is parsed (hermes_service/json_cost.py)."""
from __future__ import annotations

import json

import pytest

from hermes_service.json_cost import TooCostly, loads_bounded, token_bound, tokens_outside_strings


@pytest.mark.parametrize("text", [
    "1", "[]", "[[],[]]", '{"a": [1, 2, {"b": null}]}', '["a,b:[{", 3]', " [ 1 , 2 ] ",
])
def test_the_bound_is_never_below_the_values_parsed(text):
    def values(v):
        if isinstance(v, list):
            return 1 + sum(values(x) for x in v)
        if isinstance(v, dict):
            return 1 + sum(1 + values(x) for x in v.values())
        return 1
    n = values(json.loads(text))
    assert token_bound(text) >= n and token_bound(text.encode()) >= n
    assert tokens_outside_strings(text, 10 ** 6) >= n


def test_commas_inside_strings_do_not_count_outside_them():
    text = json.dumps([{"arguments": "1,2,3:[{\\\"x\\\"}\n" * 10_000}])
    assert token_bound(text) > 40_000
    assert tokens_outside_strings(text, 100) < 10
    assert loads_bounded(text, 100)[0]["arguments"].startswith("1,2")


@pytest.mark.parametrize("text", [
    "[" + "[]," * 100_000 + "[]]", '["' + '","' * 100_000 + '"]', "{" + '"a":1,' * 50_000 + '"b":2}',
])
def test_many_values_are_refused_before_any_parse_in_few_steps(text):
    with pytest.raises(TooCostly):
        loads_bounded(text, 1000)
    assert tokens_outside_strings(text, 1000) == 1001


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "[1,", '"abc', "\ud800x"])
def test_what_is_not_json_is_a_value_error(text):
    with pytest.raises(ValueError):
        loads_bounded(text, 10 ** 6)

"""The tool gateway's ``suggestion.created`` (docs/mnote-client.md §Suggestions): only for a
stored suggestion whose id is an id — a kernel's answer is not trusted further."""
from __future__ import annotations

import pytest

from hermes_service.mnote.gateway import suggestion_created


def answer(result, ok=True, effect="write"):
    return {"ok": ok, "result": result, "audit": {"effect": effect}}


def test_a_stored_suggestion_is_named():
    assert suggestion_created("mnote.block.propose", answer({"suggestionId": "sug_1"})) == "sug_1"


@pytest.mark.parametrize("tool, out", [
    ("mnote.block.batch", answer({"suggestionId": "sug_1"})),            # another tool
    ("mnote.block.propose", answer({"suggestionId": "sug_1"}, effect="dry_run")),
    ("mnote.block.propose", answer(None, ok=False, effect="none")),
    ("mnote.block.propose", answer({"suggestionId": "x" * 300})),          # a hostile kernel's
    ("mnote.block.propose", answer({"suggestionId": "../../etc"})),
    ("mnote.block.propose", answer({"suggestionId": {"nested": 1}})),
    ("mnote.block.propose", answer({})),
    ("mnote.block.propose", {"ok": True, "result": "not an object", "audit": None}),
    ("mnote.block.propose", {"ok": True, "result": "not an object",
                             "audit": {"effect": "write"}}),
])
def test_nothing_else_is(tool, out):
    assert suggestion_created(tool, out) is None

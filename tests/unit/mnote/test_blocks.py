"""Block ops as pure functions (docs/mnote-tools.md §Block tools): the hash's definition and a
batch's plan — order, ids, what stays, what is refused."""
from __future__ import annotations

import hashlib
import itertools

import pytest

from hermes_service.mnote.blocks import MAX_PAGE_BLOCKS, block_hash, plan_ops, with_hashes
from hermes_service.mnote.page_store import BadToolInput, Conflict

PAGE = [{"id": "a", "type": "p", "text": "A", "color": "red"},
        {"id": "b", "type": "p", "text": "B"}, {"id": "c", "type": "p", "text": "C"}]


def ids():
    counter = itertools.count(1)
    return lambda: f"n{next(counter)}"


def test_the_hash_is_the_documented_one():
    for kind, text in (("heading", "章节一"), ("", ""), ("p", "a\u0000b"), ("x" * 64, "😀")):
        raw = str(len(kind.encode())).encode() + b":" + kind.encode() + text.encode()
        assert block_hash({"type": kind, "text": text}) == hashlib.sha256(raw).hexdigest()[:16]
    assert block_hash({"type": "p", "text": "\ud800"})          # a lone surrogate: no crash
    assert with_hashes(PAGE)[0] == {**PAGE[0], "hash": block_hash(PAGE[0])}


def test_ops_apply_in_order():
    planned = plan_ops(PAGE, [
        {"op": "insert", "after": None, "block": {"type": "h", "text": "top"}},
        {"op": "insert", "after": "c", "block": {"type": "p", "text": "end"}},
        {"op": "update", "blockId": "a", "expectHash": block_hash(PAGE[0]),
         "block": {"text": "A2"}},
        {"op": "move", "blockId": "c", "after": None},
        {"op": "delete", "blockId": "b", "expectHash": block_hash(PAGE[1])}], new_id=ids())
    assert [b["id"] for b in planned.blocks] == ["c", "n1", "a", "n2"]
    assert planned.blocks[2] == {"id": "a", "type": "p", "text": "A2", "color": "red"}
    assert [s["op"] for s in planned.steps] == ["insert", "insert", "update", "move", "delete"]
    assert [t["id"] for t in planned.touched] == ["n1", "n2", "a", "c"]
    assert PAGE[0]["text"] == "A"                                # the input is not changed


@pytest.mark.parametrize("ops, error, where", [
    ([{"op": "delete", "blockId": "b", "expectHash": block_hash(PAGE[1])},
      {"op": "insert", "after": "b", "block": {"type": "p", "text": "x"}}],
     BadToolInput, "/args/ops/1/after"),
    ([{"op": "delete", "blockId": "b", "expectHash": block_hash(PAGE[1])},
      {"op": "delete", "blockId": "b", "expectHash": block_hash(PAGE[1])}],
     BadToolInput, "/args/ops/1/blockId"),
    ([{"op": "move", "blockId": "a", "after": "a"}], BadToolInput, "/args/ops/0/after"),
    ([{"op": "move", "blockId": "zz", "after": None},
      {"op": "update", "blockId": "c", "expectHash": "0" * 16, "block": {"text": "x"}}],
     Conflict, "zz, c"),
])
def test_refused(ops, error, where):
    with pytest.raises(error) as exc:
        plan_ops(PAGE, ops, since=3)
    assert where in exc.value.message


def test_a_batch_may_not_grow_a_page_past_the_bound():
    page = [{"id": f"b{i}", "type": "p", "text": ""} for i in range(MAX_PAGE_BLOCKS)]
    with pytest.raises(BadToolInput):
        plan_ops(page, [{"op": "insert", "after": None, "block": {"type": "p", "text": "x"}}])
    assert plan_ops(page, [{"op": "delete", "blockId": "b0", "expectHash": block_hash(page[0])}])

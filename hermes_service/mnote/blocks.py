"""Block operations on a page body: the block hash and a batch's plan (docs/mnote-tools.md
§Block tools, this service's addition to tool contract v1).

Pure functions over the blocks ``page.get`` returns (``{id, type, text, …}``), shared by the
embedded store (:mod:`.block_store`) and, through it, the reference kernel:

* :func:`block_hash` — what ``page.get`` adds to each block as ``hash``;
* :func:`plan_ops` — check a batch's ops against the page and apply them in order, or
  raise: :class:`~.page_store.Conflict` naming every block that changed since it was read
  (its hash is not the op's ``expectHash``, or it is gone), :class:`~.page_store.BadToolInput`
  naming the op (``/args/ops/<i>/…``) for a batch that contradicts itself.
"""
from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from .page_store import BadToolInput, Conflict
from .schemas import HASH_DIGITS

#: a batch may not grow a page beyond this many blocks
MAX_PAGE_BLOCKS = 5000
#: the most block ids a conflict message names (the rest are counted)
MAX_NAMED = 20


def block_hash(block: dict) -> str:
    """The first 16 hex digits of SHA-256 over ``<n>:<type><text>``, UTF-8, ``n`` the length
    of ``type`` in bytes (decimal): equal for blocks of equal type and text, whatever their id
    or other fields."""
    kind = str(block.get("type", "")).encode("utf-8", "surrogatepass")
    text = str(block.get("text", "")).encode("utf-8", "surrogatepass")
    return hashlib.sha256(str(len(kind)).encode() + b":" + kind + text).hexdigest()[:HASH_DIGITS]


def with_hashes(blocks: list[dict]) -> list[dict]:
    """``blocks`` each with its ``hash`` beside its ``id`` (page.get's blocks)."""
    return [{**b, "hash": block_hash(b)} for b in blocks]


def new_block_id() -> str:
    return f"blk_{secrets.token_hex(6)}"


@dataclass
class Planned:
    """A batch applied to a copy of the page: ``blocks`` the body after it, ``steps`` what
    each op did (``{op, blockId, hash?, after?}``, in the ops' order), ``touched`` the
    ``{id, hash}`` of each block the batch inserted, updated or moved that is still there."""
    blocks: list[dict]
    steps: list[dict]
    touched: list[dict]


def stale_message(ids: list[str], since: int | None) -> str:
    """The conflict message naming ``ids`` (changed or gone since revision ``since``)."""
    named = ", ".join(ids[:MAX_NAMED]) + (f" 等 {len(ids)} 个" if len(ids) > MAX_NAMED else "")
    when = f"（基于版本 {since}）" if since is not None else ""
    return f"块已被他人修改或删除{when}：{named}；请重新读取页面后重试"


def check_refs(blocks: list[dict], ops: list[dict], since: int | None) -> None:
    """Conflict naming every block an op refers to (``blockId``, ``after``) that is not on the
    page, or whose hash is not the op's ``expectHash``."""
    hashes = {b["id"]: block_hash(b) for b in blocks}
    stale: list = []
    for op in ops:
        for key in ("blockId", "after"):
            ref = op.get(key)
            if ref is not None and ref not in hashes and ref not in stale:
                stale.append(ref)
        ref, expect = op.get("blockId"), op.get("expectHash")
        if expect is not None and ref in hashes and hashes[ref] != expect and ref not in stale:
            stale.append(ref)
    if stale:
        raise Conflict(stale_message(stale, since))


def _index(body: list[dict], block_id: str) -> int:
    return next(n for n, b in enumerate(body) if b["id"] == block_id)


def _after(body: list[dict], after: str | None) -> int:
    """Where a block put after ``after`` goes (null: the top)."""
    return 0 if after is None else _index(body, after) + 1


def _apply(body: list[dict], op: dict, new_id: Callable[[], str]) -> dict:
    """Apply one checked op to ``body`` in place; its step ``{op, blockId, hash?, after?}``."""
    kind, ref, after = op["op"], op.get("blockId", ""), op.get("after")
    if kind == "insert":
        block = {"id": new_id(), "type": op["block"]["type"], "text": op["block"]["text"]}
        body.insert(_after(body, after), block)
        return {"op": "insert", "blockId": block["id"], "after": after,
                "hash": block_hash(block)}
    n = _index(body, ref)
    if kind == "update":
        body[n] = {**body[n], "text": op["block"]["text"],
                   **({"type": op["block"]["type"]} if "type" in op["block"] else {})}
        return {"op": "update", "blockId": ref, "hash": block_hash(body[n])}
    block = body.pop(n)
    if kind == "delete":
        return {"op": "delete", "blockId": ref}
    body.insert(_after(body, after), block)
    return {"op": "move", "blockId": ref, "after": after}


def plan_ops(blocks: list[dict], ops: list[dict], *, since: int | None = None,
             new_id: Callable[[], str] = new_block_id) -> Planned:
    """Apply ``ops`` (already schema-checked) in order to a copy of ``blocks``.

    Refs and ``expectHash`` are checked against the page before the batch
    (:func:`check_refs`; ``since`` only words the message). Then, in order: ``insert`` puts
    a new block (a new id) after ``after`` (null: at the top); ``update`` sets the block's
    ``text`` and, if given, ``type`` (its id and other fields stay); ``delete`` removes it;
    ``move`` puts it after ``after`` (null: at the top). BadToolInput for an op naming a
    block an earlier op deleted, a block moved after itself, or a page growing past
    :data:`MAX_PAGE_BLOCKS`."""
    check_refs(blocks, ops, since)
    body = [dict(b) for b in blocks]
    deleted: dict[str, int] = {}
    touched: list[str] = []
    steps: list[dict] = []
    for i, op in enumerate(ops):
        for key in ("blockId", "after"):
            if op.get(key) in deleted:
                raise BadToolInput(f"/args/ops/{i}/{key}: block {op[key]!r} was deleted by op "
                                   f"{deleted[op[key]]}")
        if op["op"] == "move" and op.get("after") == op["blockId"]:
            raise BadToolInput(f"/args/ops/{i}/after: a block cannot move after itself")
        step = _apply(body, op, new_id)
        steps.append(step)
        if op["op"] == "delete":
            deleted[step["blockId"]] = i
        elif step["blockId"] not in touched:
            touched.append(step["blockId"])
    if len(body) > max(MAX_PAGE_BLOCKS, len(blocks)):
        raise BadToolInput(f"/args/ops: the page would have {len(body)} blocks, more than "
                           f"{MAX_PAGE_BLOCKS}")
    by_id = {b["id"]: b for b in body}
    return Planned(body, steps, [{"id": t, "hash": block_hash(by_id[t])}
                                 for t in touched if t in by_id])

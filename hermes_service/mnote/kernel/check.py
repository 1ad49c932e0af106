"""``main.py mnote check-kernel``: the tool contract's cases against any kernel, through the
same transports and answer checks as the service (docs/mnote-tools.md §Conformance check).

The kernel needs one page the ``actor`` may write (``workspace``/``document``: the check
appends a few marked blocks to it — use a test page) and an ``outsider`` who is no member of
that workspace (default: a fresh random actor id). Each case prints one line, ``PASS`` or
``FAIL`` with the reason; :func:`run` returns the number of failed cases:

* ``read`` — page.get answers ok, effect read, no commandId, a title and blocks;
* ``write`` — page.save answers effect write with an ``audit.commandId``; the page shows it;
* ``dry_run`` — a dryRun page.save answers effect dry_run and the page is unchanged;
* ``idempotent_replay`` — the same ``idempotencyKey`` twice: the same commandId, one write;
* ``idempotency_conflict`` — that key again with other arguments:
  ``mnote_tool_idempotency_conflict``, nothing written;
* ``permission_denied`` — the outsider's page.get and page.save:
  ``mnote_tool_permission_denied``, no title or block text in the answer, nothing written;
* ``unknown_option`` — page.update_options with an option the contract does not name:
  refused, nothing written;
* ``malformed_envelope`` — not JSON, not an object, no ``toolCallId``, ``args`` not an
  object, a string ``dryRun``: each answered with a failure envelope, nothing written;
* ``credential_required`` (HTTP with a credential only) — a call without it is refused;
* the block tools and suggestions (docs/mnote-tools.md §Block tools, §Suggestions):
  ``block_atomic`` (a batch with one stale op changes nothing; a good one inserts, with the
  documented block hash), ``block_expect_hash`` (an update with a wrong ``expectHash`` is a
  conflict naming the block; with the right one it applies), ``block_revisions`` (after
  another write, ``requiredRevision`` refuses and ``baseRevision`` applies), and
  ``suggestion_life`` (propose: the page unchanged, listed; accept applies it once, a second
  answer is ``mnote_tool_suggestion_closed``; reject).

Every answer must also be a valid envelope for its call (:func:`~.kernel_wire.read_answer`).
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..blocks import block_hash
from ..schemas import READ_TOOLS
from .adapter import KernelBackend, read_exchange, redact
from .wire import KernelAnswer, KernelFailure, encode, parse_json

SCOPE = ["page.read", "page.write", "page.suggest", "artifact.write"]
DENIED = "mnote_tool_permission_denied"


class CaseFailed(Exception):
    """A case's rule was broken (the message says how)."""


@dataclass(frozen=True)
class Target:
    """The page the check works on and who it calls as."""
    workspace: str
    document: str
    actor: str
    outsider: str


class Checker:
    """The cases' calls against one transport."""

    def __init__(self, transport, target: Target, timeout: float):
        self.transport, self.target, self.timeout = transport, target, timeout
        self.backend = KernelBackend(transport, timeout)
        self.tag = secrets.token_hex(4)
        self._n = 0

    def marker(self, label: str) -> str:
        return f"hermes-service check-kernel {self.tag} {label}"

    def envelope(self, tool: str, args: dict, *, actor: str | None = None, key: str | None = None,
                 dry: bool = False) -> dict:
        self._n += 1
        return {"toolName": tool, "workspaceId": self.target.workspace,
                "documentId": self.target.document, "actorId": actor or self.target.actor,
                "sessionId": f"check_kernel_{self.tag}", "runId": f"check_{self.tag}",
                "toolCallId": f"call_{self.tag}_{self._n}", "traceId": f"trace_check_{self.tag}",
                "idempotencyKey": key if key is not None else
                (None if tool in READ_TOOLS else f"check_{self.tag}_{self._n}"),
                "dryRun": dry, "capabilityScope": list(SCOPE), "args": args}

    def call(self, sent: dict) -> tuple[KernelAnswer, str]:
        """(the checked answer, its text); CaseFailed when there is no valid envelope."""
        deadline = time.monotonic() + self.timeout
        try:
            status, data = self.transport.exchange(encode(sent), deadline)
            answer = read_exchange(self.transport, status, data, sent)
        except KernelFailure as failure:
            raise CaseFailed(f"{sent['toolName']}: no valid answer ({failure.reason}: "
                             f"{failure.detail})") from None
        return answer, data.decode("utf-8", "replace")

    def ok(self, sent: dict) -> KernelAnswer:
        answer, _ = self.call(sent)
        if not answer.ok:
            raise CaseFailed(f"{sent['toolName']} answered {answer.code}: {answer.message}")
        return answer

    def save(self, text: str, **kw) -> dict:
        return self.envelope("mnote.page.save", {"content": [{"type": "paragraph", "text": text}],
                                                 "mode": "append"}, **kw)

    def page(self) -> dict:
        result = self.ok(self.envelope("mnote.page.get", {})).result or {}
        if not isinstance(result.get("title"), str) or not isinstance(result.get("blocks"), list):
            raise CaseFailed("page.get's result has no title string or no blocks list")
        return result

    @staticmethod
    def texts(page: dict) -> list[str | None]:
        return [b.get("text") for b in page["blocks"] if isinstance(b, dict)]

    def snapshot(self) -> str:
        page = self.page()
        return json.dumps([page.get("title"), self.texts(page), page.get("pageOptions"),
                           page.get("revision")], sort_keys=True, ensure_ascii=False)

    def unchanged(self, before: str, what: str) -> None:
        if self.snapshot() != before:
            raise CaseFailed(f"the page changed after {what}")


def case_read(c: Checker) -> str:
    page = c.page()
    return f"title and {len(page['blocks'])} block(s), effect read, no commandId"


def case_write(c: Checker) -> str:
    text = c.marker("write")
    answer = c.ok(c.save(text))
    if text not in c.texts(c.page()):
        raise CaseFailed("page.save answered ok but page.get does not show the block")
    return f"effect write, audit.commandId {(answer.command_id or '')[:60]!r}"


def case_dry_run(c: Checker) -> str:
    before = c.snapshot()
    c.ok(c.save(c.marker("dry run"), dry=True))
    c.unchanged(before, "a dryRun page.save")
    return "effect dry_run, the page unchanged"


def case_idempotent_replay(c: Checker) -> str:
    key, text = f"check_{c.tag}_replay", c.marker("replay")
    first, second = c.ok(c.save(text, key=key)), c.ok(c.save(text, key=key))
    if first.command_id != second.command_id:
        raise CaseFailed("the same idempotencyKey answered two commandIds")
    count = c.texts(c.page()).count(text)
    if count != 1:
        raise CaseFailed(f"the same idempotencyKey twice wrote the block {count} times")
    return "the same commandId, one write"


def case_idempotency_conflict(c: Checker) -> str:
    key = f"check_{c.tag}_conflict"
    c.ok(c.save(c.marker("conflict a"), key=key))
    other = c.marker("conflict b")
    answer, _ = c.call(c.save(other, key=key))
    if answer.ok or answer.code != "mnote_tool_idempotency_conflict":
        raise CaseFailed(f"the same key with other arguments answered "
                         f"{'ok' if answer.ok else answer.code}, "
                         "not mnote_tool_idempotency_conflict")
    if other in c.texts(c.page()):
        raise CaseFailed("the conflicting call wrote its block")
    return "mnote_tool_idempotency_conflict, nothing written"


def case_permission_denied(c: Checker) -> str:
    page = c.page()
    secrets_ = [t for t in [page["title"], *c.texts(page)] if isinstance(t, str) and len(t) >= 4]
    before = c.snapshot()
    for sent in (c.envelope("mnote.page.get", {}, actor=c.target.outsider),
                 c.save(c.marker("outsider"), actor=c.target.outsider)):
        answer, text = c.call(sent)
        if answer.ok or answer.code != DENIED:
            raise CaseFailed(f"the outsider's {sent['toolName']} answered "
                             f"{'ok' if answer.ok else answer.code}, not {DENIED}")
        shown = json.dumps(parse_json(text.encode()), ensure_ascii=False) + text
        if any(s in shown for s in secrets_):
            raise CaseFailed(f"the outsider's {sent['toolName']} answer shows the page's title "
                             "or text")
    c.unchanged(before, "the outsider's page.save")
    return f"{DENIED} for page.get and page.save, nothing leaked or written"


def case_unknown_option(c: Checker) -> str:
    before = c.snapshot()
    answer, _ = c.call(c.envelope("mnote.page.update_options",
                                  {"options": {"hermesCheckUnknownOption": True}}))
    if answer.ok:
        raise CaseFailed("page.update_options accepted an option the contract does not name")
    c.unchanged(before, "the refused page.update_options")
    return f"refused with {answer.code}"


def case_malformed_envelope(c: Checker) -> str:
    before = c.snapshot()
    no_call_id = c.envelope("mnote.page.get", {})
    del no_call_id["toolCallId"]
    bad_args = {**c.save(c.marker("malformed")), "args": "not an object"}
    bad_dry = {**c.save(c.marker("malformed dry")), "dryRun": "yes"}
    cases = {"not JSON": b"{not json", "not an object": b"[]",
             "no toolCallId": encode(no_call_id), "args not an object": encode(bad_args),
             "dryRun a string": encode(bad_dry)}
    for what, body in cases.items():
        try:
            status, data = c.transport.exchange(body, time.monotonic() + c.timeout)
            answer = parse_json(data)
        except KernelFailure as failure:
            raise CaseFailed(f"{what}: no failure envelope "
                             f"({failure.reason}: {failure.detail})") from None
        error = answer.get("error") if isinstance(answer, dict) else None
        if not (isinstance(answer, dict) and answer.get("ok") is False and isinstance(error, dict)
                and isinstance(error.get("code"), str)) or status >= 500:
            raise CaseFailed(f"{what}: not refused with a failure envelope (status {status})")
    c.unchanged(before, "the malformed envelopes")
    return f"{len(cases)} malformed envelopes refused, nothing written"


def case_credential_required(c: Checker) -> str:
    transport = c.transport
    if transport.transport != "http" or not transport.credential_env:
        return "SKIP: HTTP with a credential only"
    bare = type(transport)(transport.url)
    bare.context = transport.context
    status, data = bare.exchange(encode(c.envelope("mnote.page.get", {})),
                                 time.monotonic() + c.timeout)
    try:
        answer = parse_json(data)
    except KernelFailure:
        answer = None
    if 200 <= status < 300 and isinstance(answer, dict) and answer.get("ok") is True:
        raise CaseFailed("a call without the credential was answered")
    return f"a call without the credential was refused (HTTP {status})"


# -- the block tools and suggestions -------------------------------------------------------
def _block(page: dict, text: str) -> dict:
    found = [b for b in page["blocks"] if isinstance(b, dict) and b.get("text") == text]
    if len(found) != 1:
        raise CaseFailed(f"page.get shows {len(found)} block(s) with the text {text[-24:]!r}")
    return found[0]


def _insert(c: Checker, text: str) -> tuple[dict, dict]:
    """Append a marked paragraph with a batch; (the page after, the new block)."""
    page = c.page()
    last = page["blocks"][-1].get("id") if page["blocks"] else None
    c.ok(c.envelope("mnote.block.batch", {"baseRevision": page.get("revision"), "ops": [
        {"op": "insert", "after": last, "block": {"type": "paragraph", "text": text}}]}))
    page = c.page()
    block = _block(page, text)
    if block.get("hash") != block_hash(block):
        raise CaseFailed(f"page.get's block hash {str(block.get('hash'))[:20]!r} is not the "
                         "documented hash of its type and text")
    return page, block


def _update(c: Checker, block: dict, text: str, expect: str, **revision) -> dict:
    return c.envelope("mnote.block.batch", {**revision, "ops": [
        {"op": "update", "blockId": block["id"], "expectHash": expect, "block": {"text": text}}]})


def _refused(c: Checker, sent: dict, code: str, what: str) -> KernelAnswer:
    answer, _ = c.call(sent)
    if answer.ok or answer.code != code:
        raise CaseFailed(f"{what} answered {'ok' if answer.ok else answer.code}, not {code}")
    return answer


def case_block_atomic(c: Checker) -> str:
    page, block = _insert(c, c.marker("block a"))
    before = c.snapshot()
    _refused(c, c.envelope("mnote.block.batch", {"baseRevision": page["revision"], "ops": [
        {"op": "insert", "after": None, "block": {"type": "paragraph",
                                                  "text": c.marker("block b")}},
        {"op": "delete", "blockId": block["id"], "expectHash": "0" * 16}]}),
        "mnote_tool_conflict", "a batch with a stale op")
    c.unchanged(before, "a refused batch")
    return "a batch with one stale op changed nothing; an insert shows its block hash"


def case_block_expect_hash(c: Checker) -> str:
    page, block = _insert(c, c.marker("hash a"))
    answer = _refused(c, _update(c, block, c.marker("hash b"), "0" * 16,
                                 baseRevision=page["revision"]),
                      "mnote_tool_conflict", "an update with a wrong expectHash")
    if block["id"] not in (answer.message or ""):
        raise CaseFailed("the conflict's message does not name the block")
    c.ok(_update(c, block, c.marker("hash c"), block["hash"], baseRevision=page["revision"]))
    _block(c.page(), c.marker("hash c"))
    return "a wrong expectHash is a conflict naming the block; the right one applies"


def case_block_revisions(c: Checker) -> str:
    page, block = _insert(c, c.marker("rev a"))
    c.ok(c.save(c.marker("rev other")))               # someone else's write: a new revision
    stale = _update(c, block, c.marker("rev b"), block["hash"],
                    requiredRevision=page["revision"])
    _refused(c, stale, "mnote_tool_conflict", "requiredRevision after another write")
    c.ok(_update(c, block, c.marker("rev c"), block["hash"], baseRevision=page["revision"]))
    _block(c.page(), c.marker("rev c"))
    return "requiredRevision refused after another write, baseRevision applied"


def case_suggestion_life(c: Checker) -> str:
    page, block = _insert(c, c.marker("suggest a"))
    proposed = c.ok(c.envelope("mnote.block.propose", {
        "baseRevision": page["revision"], "reason": "hermes-service check-kernel",
        "ops": [{"op": "update", "blockId": block["id"], "expectHash": block["hash"],
                 "block": {"text": c.marker("suggest b")}}]})).result or {}
    sid = proposed.get("suggestionId")
    if not isinstance(sid, str):
        raise CaseFailed("mnote.block.propose answered no suggestionId")
    _block(c.page(), c.marker("suggest a"))
    listed = c.ok(c.envelope("mnote.suggestion.list", {})).result or {}
    if sid not in [s.get("suggestionId") for s in listed.get("suggestions", [])
                   if isinstance(s, dict)]:
        raise CaseFailed("mnote.suggestion.list does not list the open suggestion")
    c.ok(c.envelope("mnote.suggestion.accept", {"suggestionId": sid}))
    _block(c.page(), c.marker("suggest b"))
    for verb in ("accept", "reject"):
        _refused(c, c.envelope(f"mnote.suggestion.{verb}", {"suggestionId": sid}),
                 "mnote_tool_suggestion_closed", f"a second answer ({verb})")
    other = c.ok(c.envelope("mnote.block.propose", {
        "baseRevision": page["revision"], "reason": "hermes-service check-kernel",
        "ops": [{"op": "insert", "after": None, "block": {
            "type": "paragraph", "text": c.marker("suggest c")}}]})).result or {}
    c.ok(c.envelope("mnote.suggestion.reject", {"suggestionId": other.get("suggestionId")}))
    if c.marker("suggest c") in c.texts(c.page()):
        raise CaseFailed("a rejected suggestion was applied")
    return "proposed (page unchanged, listed), accepted once, a second answer refused, rejected"


CASES: list[tuple[str, Callable[[Checker], str]]] = [
    ("read", case_read), ("write", case_write), ("dry_run", case_dry_run),
    ("idempotent_replay", case_idempotent_replay),
    ("idempotency_conflict", case_idempotency_conflict),
    ("permission_denied", case_permission_denied), ("unknown_option", case_unknown_option),
    ("malformed_envelope", case_malformed_envelope),
    ("credential_required", case_credential_required),
    ("block_atomic", case_block_atomic), ("block_expect_hash", case_block_expect_hash),
    ("block_revisions", case_block_revisions), ("suggestion_life", case_suggestion_life),
]


def run(transport, target: Target, timeout: float, echo: Callable[[str], None]) -> int:
    """Run every case, one line each and a summary; the number of failed cases."""
    checker, failed = Checker(transport, target, timeout), []
    width = max(len(name) for name, _ in CASES)
    for name, case in CASES:
        try:
            note = case(checker)
            verdict = "SKIP" if note.startswith("SKIP: ") else "PASS"
            note = note.removeprefix("SKIP: ")
        except CaseFailed as exc:
            verdict, note = "FAIL", str(exc)
            failed.append(name)
        except KernelFailure as exc:
            verdict, note = "FAIL", f"no valid answer ({exc.reason}: {exc.detail})"
            failed.append(name)
        shown = redact(note, getattr(transport, "credential_env", None))
        echo(f"{verdict} {name:<{width}}  {shown}")
    passed = len(CASES) - len(failed)
    echo(f"check-kernel: {len(CASES)} cases, {passed} passed or skipped, {len(failed)} failed"
         + (f": {', '.join(failed)}" if failed else ""))
    return len(failed)

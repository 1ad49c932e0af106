"""The page context of a run (client-proxy contract §1: run input, not session truth;
docs/mnote-client.md): a delimited JSON block of the page's ids, title, options, outline and
selection, capped in bytes, that the mnote plugin hands Hermes with this run's message only."""
from __future__ import annotations

import json

CONTEXT_BUDGET = 8192   # bytes of the page-context block
CONTEXT_HEAD = ("[mnote page context for this message only; use the mnote tools to read or change "
                "the page]")
CONTEXT_END = "\n[end of mnote page context]"
_LEGACY_END = "\n[end of mnote page context]\n\n"


def page_context(body: dict) -> str:
    """The run's page-context block: a delimited JSON object of the page's ids, ``title``,
    ``pageOptions``, ``outline``, ``selectedBlockId`` and ``selectedText`` (client-proxy
    contract §1: pageContext is run input, not session truth).

    The mnote plugin hands it to Hermes as ``pre_llm_call`` context, so it is appended to the
    API copy of this run's message only (docs/mnote-client.md). At most
    ``CONTEXT_BUDGET`` bytes: the outline is cut first, then long texts, then whole fields.
    """
    ctx = {"workspaceId": body["workspaceId"], "documentId": body["documentId"]}
    page = body.get("pageContext") or {}
    for key in ("title", "pageOptions", "outline"):
        if page.get(key) not in (None, [], {}):
            ctx[key] = page[key]
    for key in ("selectedBlockId", "selectedText"):
        if body.get(key):
            ctx[key] = body[key]

    def size() -> int:
        return len(json.dumps(ctx, ensure_ascii=False).encode())
    while size() > CONTEXT_BUDGET and ctx.get("outline"):  # 1. the outline, halving
        ctx["outline"] = ctx["outline"][: len(ctx["outline"]) // 2]
    for key in ("selectedText", "title"):                  # 2. long texts, shortened
        while size() > CONTEXT_BUDGET and len(ctx.get(key) or "") > 64:
            ctx[key] = ctx[key][: len(ctx[key]) // 2] + "…"
    for key in ("pageOptions", "outline", "selectedText", "title", "selectedBlockId"):
        if size() > CONTEXT_BUDGET:                        # 3. whole fields, dropped
            ctx.pop(key, None)
    return f"{CONTEXT_HEAD}\n{json.dumps(ctx, ensure_ascii=False)}{CONTEXT_END}"


def strip_context(content: str | None) -> str | None:
    """A user message stored before page context moved to run files (the block used to be
    put before the message): what the user typed."""
    if content and content.startswith(CONTEXT_HEAD) and _LEGACY_END in content:
        return content.split(_LEGACY_END, 1)[1]
    return content

"""Each tool call's own name, told to the service (``hermes acp`` processes; docs/mnote-client.md
§Tool events). Standard library only, loaded by ``sitecustomize`` inside the Hermes process.

Hermes 0.19.0's ACP adapter reports a tool call (``session/update`` ``tool_call``) with a
``title`` made for display — ``terminal: <the command>``, ``read: <path>``, ``patch
(replace): <path>``, the bare name for other tools (``acp_adapter.tools.build_tool_title``) —
and no field naming the tool; ``rawInput`` is left out for most of Hermes's own tools. So that
the service can report ``tool_name`` in one form and the detail apart from it, this hook wraps
``acp_adapter.tools.build_tool_start`` (before ``acp_adapter.events`` and ``server`` import
the name) and adds ACP's extension field ``_meta``:
``{"hermesService": {"toolName": <the name the model called>, "preview": <detail>}}``.
``preview`` is the call's main argument as given — the whole command of ``terminal``, the
code of ``execute_code``, the path of the file tools, the pattern, query or URL of a search or
fetch (:data:`MAIN_ARGUMENT`) — else Hermes's own one-line preview of the call
(``agent.display.build_tool_preview``, what its CLI shows), with secrets redacted the way
Hermes redacts an approval's command (``agent.redact.redact_sensitive_text``, forced on), at
most :data:`PREVIEW_CHARS` characters. (Hermes's preview of a command drops what it takes for
plumbing — ``cd …``, ``export …``, ``source …`` — and of a file keeps its name only: not
what a user approving of the agent's work should be shown.) Nothing else of the update
changes. The service treats both as untrusted text from the sandbox (checked and bounded
again there).

**Every call's end is reported.** Hermes 0.19.0 reports a call's end from its step callback
with the call's arguments as the JSON *text* the model sent, and its result formatters for
``read_file`` (and the other tools whose formatter reads the arguments) call ``.get`` on it:
the ``AttributeError`` is swallowed and the call's ``tool_call_update`` never sent — a panel
would show that call running for ever. The hook also wraps ``build_tool_complete``: text
arguments are parsed into the object Hermes expects, and should the formatting still fail,
the update is sent without content (its status as Hermes judges the result).
"""
import functools
import json

META_KEY = "hermesService"
PREVIEW_CHARS = 4096          # what crosses the pipe; the service keeps less
#: tool → the argument that says what the call does
MAIN_ARGUMENT = {
    "terminal": "command", "execute_code": "code", "read_file": "path", "write_file": "path",
    "patch": "path", "search_files": "pattern", "web_search": "query", "web_extract": "urls",
    "browser_navigate": "url", "skill_view": "name", "skill_manage": "name",
    "delegate_task": "goal", "clarify": "question", "vision_analyze": "question",
}


def preview_of(name, arguments):
    """The preview of a call of ``name`` with ``arguments`` (see the module doc), redacted;
    None when there is none (or it cannot be made)."""
    args = arguments if isinstance(arguments, dict) else {}
    try:
        from agent.redact import redact_sensitive_text
        value = args.get(MAIN_ARGUMENT.get(name, ""))
        if isinstance(value, list):
            value = " ".join(v if isinstance(v, str) else str(v.get("url", "")) if
                             isinstance(v, dict) else str(v) for v in value)
        if value in (None, ""):
            from agent.display import build_tool_preview
            value = build_tool_preview(name, args, max_len=0)
        if value in (None, ""):
            return None
        text = redact_sensitive_text(str(value), force=True)
    except Exception:     # noqa: BLE001 - a preview must never break the tool call
        return None
    return text[:PREVIEW_CHARS]


def _with_meta(original):
    @functools.wraps(original)
    def build_tool_start(tool_call_id, tool_name, arguments, *args, **kwargs):
        update = original(tool_call_id, tool_name, arguments, *args, **kwargs)
        try:
            meta = dict(getattr(update, "field_meta", None) or {})
            meta[META_KEY] = {"toolName": tool_name if isinstance(tool_name, str) else None,
                              "preview": preview_of(tool_name, arguments)}
            update.field_meta = meta
        except Exception:     # noqa: BLE001 - the update goes out as Hermes made it
            pass
        return update
    return build_tool_start


def _parsed(arguments):
    """The call's arguments as an object (the model's JSON text parsed), or None."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def _always_ends(original, module):
    @functools.wraps(original)
    def build_tool_complete(tool_call_id, tool_name, result=None, function_args=None,
                            snapshot=None, **kwargs):
        try:
            return original(tool_call_id, tool_name, result=result,
                            function_args=_parsed(function_args), snapshot=snapshot, **kwargs)
        except Exception:     # noqa: BLE001 - report the end without Hermes's formatting
            import acp
            try:
                failed = module._tool_result_failed(result, tool_name)
            except Exception:     # noqa: BLE001
                failed = False
            return acp.update_tool_call(tool_call_id, status="failed" if failed else "completed")
    return build_tool_complete


def patch(module):
    """Wrap ``module.build_tool_start`` and ``build_tool_complete`` (``acp_adapter.tools``)
    once."""
    for name, wrap in (("build_tool_start", _with_meta),
                       ("build_tool_complete", lambda f: _always_ends(f, module))):
        original = getattr(module, name, None)
        if original is not None and not getattr(original, "_hermes_service", False):
            wrapped = wrap(original)
            wrapped._hermes_service = True
            setattr(module, name, wrapped)

"""Hermes plugin ``hermes_service``: run plumbing for hermes-service (standard library only).

* **Turn marker** (``HERMES_SERVICE_TURN_FILE``): at the start of each turn (``pre_llm_call``)
  the Hermes session id is written to that file, so a CLI turn killed before it printed its
  ``session_id`` line (abort, timeout) is matched to its Hermes session exactly.
* **ACP tool policy** (``HERMES_SERVICE_ACP_TOOLSETS``, comma-separated, may be empty):
  Hermes's ACP adapter offers every session the fixed ``hermes-acp`` toolset (terminal,
  files, code execution, …) and has no option to change it. In processes started by
  hermes-service's ACP runner the toolset is replaced by exactly the toolsets the service
  allows (``hermes.toolsets`` plus ``mnote`` for mnote runs) — the same set the CLI runner
  passes with ``-t``.
"""
import os
import tempfile


def _restrict_acp_toolsets():
    allowed = os.environ.get("HERMES_SERVICE_ACP_TOOLSETS")
    if allowed is None:
        return
    import toolsets  # Hermes's toolset table (hermes-agent 0.19.0)
    toolsets.TOOLSETS["hermes-acp"] = {
        "description": "hermes-service: the toolsets this service allows",
        "tools": [],
        "includes": [t for t in allowed.split(",") if t],
    }


def _mark_turn(session_id="", **_kw):
    path = os.environ.get("HERMES_SERVICE_TURN_FILE")
    if not path or not session_id:
        return None
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".turn.")
    with os.fdopen(fd, "w") as fh:
        fh.write(session_id)
    os.replace(tmp, path)
    return None


def register(ctx):
    _restrict_acp_toolsets()
    ctx.register_hook("pre_llm_call", _mark_turn)

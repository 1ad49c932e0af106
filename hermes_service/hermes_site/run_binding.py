"""The run binding of a route family's Hermes plugin, kept in the Hermes process's memory only
(docs/mnote-tools.md §Run binding). Loaded in every Hermes process the service starts (this
folder is on its ``PYTHONPATH``) and imported by the service for the two names below.

A run binding is what a plugin needs for one run — for mnote: the tool URL, the run token,
the ids, the page context (:meth:`hermes_service.mnote.gateway.ToolGateway.run_binding`).
It never lies in a file: every tool process of the user (of this run or of another run, on
this or another page) could read a file its Hermes can read. It reaches Hermes

* for a CLI turn (one process, one run): in the variable :data:`ENV` (the binding's JSON,
  base64url), which the service's import hook takes out of the environment at start
  (:func:`take_env`), before Hermes starts any process;
* for a warm ``hermes acp`` process (many sessions, one run each at a time): in the
  ``_meta`` of each ``session/prompt`` under :data:`META` (ACP's field for extensions),
  which the import hook takes from the request and holds for that session while the prompt
  runs (:func:`enter` / :func:`leave`).

Hermes is non-dumpable (the import hook's guard), so no other process of the user can read
it from Hermes's memory. A plugin asks :func:`binding` with the ``task_id`` Hermes gives its
tools and hooks (the ACP session id in an ACP process).

Standard library only.
"""
import base64
import json
import os
import threading

#: the variable of a CLI turn's binding (taken out of the environment at start)
ENV = "HERMES_SERVICE_RUN"
#: the key of a ``session/prompt`` request's ``_meta`` holding the binding
META = "hermesServiceRun"

_lock = threading.Lock()
_process = None          # a CLI turn's binding
_sessions: dict = {}           # ACP session id -> (binding, mark)


def encode(binding: dict) -> str:
    """``binding`` as the value of :data:`ENV`."""
    raw = json.dumps(binding, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return base64.urlsafe_b64encode(raw).decode("ascii")


def decode(value):
    """The binding in a value of :data:`ENV` (None when it is not one)."""
    try:
        data = json.loads(base64.urlsafe_b64decode(value.encode("ascii")).decode("utf-8"))
    except (AttributeError, ValueError, UnicodeError):
        return None
    return data if isinstance(data, dict) else None


def take_env():
    """Take :data:`ENV` out of this process's environment and keep its binding."""
    global _process
    value = os.environ.pop(ENV, None)
    if value is not None:
        _process = decode(value)


def enter(session_id, binding):
    """Hold ``binding`` (a dict, else nothing) for ``session_id`` while its prompt runs;
    returns the mark :func:`leave` needs."""
    if not isinstance(binding, dict) or not isinstance(session_id, str):
        return None
    mark = object()
    with _lock:
        _sessions[session_id] = (binding, mark)
    return mark


def leave(session_id, mark):
    """Forget the binding :func:`enter` gave ``mark`` (not a later one of the session)."""
    with _lock:
        held = _sessions.get(session_id)
        if mark is not None and held is not None and held[1] is mark:
            del _sessions[session_id]


def binding(task_id=None) -> dict:
    """The binding of the run ``task_id`` belongs to: its ACP session's while that prompt
    runs, else this CLI turn's, else ``{}`` (a copy: the caller may change it)."""
    with _lock:
        held = _sessions.get(task_id) if isinstance(task_id, str) else None
        found = held[0] if held is not None else _process
    return dict(found) if isinstance(found, dict) else {}

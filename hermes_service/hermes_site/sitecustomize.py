"""Loaded by the Python of every Hermes process the service starts (``PYTHONPATH`` names this
folder: ``UserHomes.cli_env``; docs/runners.md, §A message is text).

``hermes chat --query=…`` treats a query that starts like a path of an existing local image
file (``/…``, ``~/…``, ``./…``, ``file://…``; Hermes 0.19.0 ``cli._detect_file_drop``, called
by ``cli._collect_query_images``) as a dragged-in attachment: it reads that file from the
server and sends it to the model instead of the text. A caller could so probe for files
anywhere on the host and have a vision model describe them. A message given to the service
is always text: this hook makes ``_detect_file_drop`` find nothing, as soon as Hermes's ``cli``
module is imported. Explicit ``--image`` arguments (which the service never passes) are
untouched. Plugins load too late for this (after the query was handled), hence a hook here.

**How long Hermes waits for an approval** (``hermes acp`` only; docs/mnote-client.md §Approvals).
Hermes 0.19.0's ACP adapter asks the client before a dangerous command or an edit and waits for the
answer at most ``timeout`` seconds (``acp_adapter.permissions.make_approval_callback`` and
``acp_adapter.edit_approval.make_acp_edit_approval_requester``, default 60; ``server.py`` passes
none), then denies. The service waits for the user up to ``hermes.approvals.timeout_seconds`` and
answers ``deny`` itself at that time; so that Hermes never gives up first (leaving the user a
question nobody waits for), the service's ACP processes get ``HERMES_SERVICE_APPROVAL_TIMEOUT``
(seconds: ours plus a margin) and this hook makes it the default ``timeout`` of both functions.
Nothing else changes; without the variable both stay as they are.

**An ``always`` answer lasts for the process** (same processes, same variable). Hermes keeps
an ``always`` approval in memory for the life of the process and also tries to save it into
``$HERMES_HOME/config.yaml`` ``command_allowlist`` (``tools.approval.save_permanent_allowlist``).
That file is the service's (rendered from the users' template, read-only inside the
sandbox): the save is made a no-op here, so an ``always`` is honoured by that user's warm
process until it ends, in every sandbox mode alike, and never written to disk.

**Clarifying questions reach the client** (``HERMES_SERVICE_CLARIFY=1``: the service's ACP
processes whose turns can ask the panel's user). Hermes 0.19.0's ``clarify`` tool calls
``agent.clarify_callback``, which the ACP adapter never sets (the tool then answers "not
available in this execution context"), and ACP has no request for a question. Here the tool
(``tools.clarify_tool.clarify_tool``, looked up at each call) gets, when it has no callback,
one that sends the client the extension request ``_hermes_service/clarify`` ``{sessionId,
question, choices}`` on the connection of the turn's ACP session (learnt from the
``make_approval_callback`` call the adapter makes for every prompt, which names the
connection, its loop and the session) and waits for ``{"answer": text}``. ``{"answer":
null}`` (nobody answered in time) becomes what Hermes's own CLI says after its clarify
timeout: the user did not provide a response, use your best judgement.

**A session's title is made in its turn** (``hermes acp``): Hermes 0.19.0 makes the title of
a session after its first exchanges in a thread of its own, once the prompt has answered
(``agent.title_generator.maybe_auto_title``), so its model call would land after the turn's
accounting. Here it runs in the prompt's own thread, before the answer returns: the call is
one of the turn's (docs/runners.md §One usage truth).

**A flagged command nobody can approve** (``unattended.py``, ``HERMES_SERVICE_UNATTENDED``):
refused at once with a text saying so, not "User denied" (docs/sandbox.md §What approvals
are).

**Each tool call names its tool** (``hermes acp``; docs/mnote-client.md §Tool events): the ACP
adapter's tool-call updates carry a display title only; ``toolcalls.py`` adds the tool's own
name and its redacted preview in ACP's ``_meta`` field.

**No container mode** (every Hermes process the service starts). Hermes 0.19.0 reads
``$HERMES_HOME/.container-mode`` at every start (``hermes_cli.config.get_container_exec_info``,
called by ``hermes_cli.main.main`` before it parses its arguments) and, when the file
exists — even empty —, replaces itself with ``<backend> exec … <hermes_bin> <args>``, every
name taken from that file: an agent writing it would choose the program that runs as its
Hermes from the next turn on. Here the lookup always answers "no container"
(docs/sandbox.md §Hermes's policy surface); the launcher also removes the file before each
sandbox starts (hermes_policy.repair).

**A restored ACP session runs on the service's model** (every ``hermes acp`` process).
Hermes 0.19.0 restores a session it does not hold from its ``state.db`` row
(``acp_adapter.session.SessionManager._restore``): the row's ``model`` and
``model_config``'s ``provider``, ``base_url`` and ``api_mode`` (else ``billing_provider``,
``billing_base_url``) override the config's — and ``state.db`` is the agent's to write: a
planted row would send the next turn to a model, provider or URL of the agent's choosing.
Here ``SessionManager._make_agent`` never gets them: every ACP session runs on the
config's (the service's) model, provider and endpoint; the row's ``cwd`` is replaced by
the service's on ``session/load`` (``update_cwd``). In Hermes's own memory, so no write to
``state.db`` at any moment can change it (docs/sandbox.md §Hermes's policy surface).

**A run's binding stays in Hermes's memory** (run_binding.py; docs/mnote-tools.md §Run
binding). A CLI turn's binding arrives in ``HERMES_SERVICE_RUN``, taken out of the
environment here before anything else runs; a warm ACP process gets each prompt's binding
in the ``_meta`` of ``session/prompt``: ``acp_adapter.server.HermesACPAgent.prompt`` is
wrapped to take it out of the request and hold it for that session while the prompt runs.
A plugin reads it with ``run_binding.binding(task_id)``; no file holds it.

**Hermes out of its tools' reach** (``HERMES_SERVICE_GUARD=1``: every Hermes process the
service starts; docs/sandbox.md §What a tool process cannot reach). The process makes itself
non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: no process of the same user may ptrace it, read
its memory or open its ``/proc/<pid>/fd/*``), and moves its standard streams to private
close-on-exec descriptors, leaving ``/dev/null`` on 0, 1 and 2: a tool command, or anything
else Hermes starts, never holds the service's pipes (an ACP process's JSON-RPC connection,
a CLI turn's output), even where Hermes lets a child inherit its streams. The variable is
taken out of the environment first, so Hermes's children do not do the same.
"""
import functools
import importlib.abc
import io
import os
import sys

#: Set by the service for the Hermes process itself (hermes_policy.HERMES_ENV); taken out of
#: the environment here, so no process Hermes starts inherits it.
GUARD_ENV = "HERMES_SERVICE_GUARD"
PR_SET_DUMPABLE = 4


def _guard():
    """Hermes out of its tools' reach (docs/sandbox.md §What a tool process cannot reach):
    non-dumpable, so no other process of its user can ptrace it or open its
    ``/proc/<pid>/mem``, ``fd/*``, ``environ`` …; and its standard streams moved to private
    close-on-exec descriptors, with ``/dev/null`` left on 0, 1 and 2, so no process it
    starts inherits the service's pipes (the ACP connection, the CLI's output)."""
    if os.environ.pop(GUARD_ENV, None) != "1":
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit(f"hermes-service: prctl(PR_SET_DUMPABLE) failed: "
                         f"{os.strerror(ctypes.get_errno())}")
    private = _private_stdio()
    _no_private_stdio_for_children(private)
    if os.getpid() == 1:
        # the sandbox's PID 1 gets no signal it has no handler for (pid_namespaces(7)): the
        # service's SIGTERM ends it as before (Hermes's own handler, where it sets one, wins)
        import signal
        signal.signal(signal.SIGTERM, lambda signum, _frame: os._exit(128 + signum))


def _private_stdio():
    """Move fds 0-2 to new close-on-exec descriptors behind new ``sys`` streams; returns
    the new descriptors."""
    null = os.open(os.devnull, os.O_RDWR)
    moved = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        if old is not None:
            try:
                old.flush()
            except (OSError, ValueError):
                pass
        try:
            new = os.dup(fd)             # non-inheritable (PEP 446): never given to a child
        except OSError:
            continue
        os.dup2(null, fd)
        moved.append(new)
        raw = io.FileIO(new, "r" if fd == 0 else "w")
        stream: io.TextIOWrapper
        if fd == 0:
            stream = io.TextIOWrapper(io.BufferedReader(raw), encoding=getattr(
                old, "encoding", None) or "utf-8", errors=getattr(old, "errors", None))
        else:
            stream = io.TextIOWrapper(io.BufferedWriter(raw), encoding=getattr(
                old, "encoding", None) or "utf-8", errors=getattr(old, "errors", None),
                line_buffering=fd == 2 or bool(getattr(old, "line_buffering", False)),
                write_through=fd == 2)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    os.close(null)
    return moved


def _no_private_stdio_for_children(private):
    """A child given one of the private streams or descriptors explicitly (``stdout=
    sys.stdout``) gets ``/dev/null`` instead."""
    import subprocess
    original = subprocess.Popen.__init__

    def mine(value):
        try:
            fd = value if isinstance(value, int) else value.fileno()
        except (AttributeError, OSError, ValueError):
            return False
        return fd in private

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        for key in ("stdin", "stdout", "stderr"):
            if kwargs.get(key) is not None and mine(kwargs[key]):
                kwargs[key] = subprocess.DEVNULL
        return original(self, *args, **kwargs)
    subprocess.Popen.__init__ = __init__  # type: ignore[method-assign]


def _no_container():
    return None


def _no_container_mode(module):
    if hasattr(module, "get_container_exec_info"):
        module.get_container_exec_info = _no_container


def _bind_runs(module):
    """Wrap the ACP agent's ``prompt`` to hold the run binding of its ``_meta`` meanwhile."""
    agent = getattr(module, "HermesACPAgent", None)
    original = getattr(agent, "prompt", None)
    if agent is None or original is None:
        return

    @functools.wraps(original)
    async def prompt(self, prompt, session_id, *args, **kwargs):
        mark = run_binding.enter(session_id, kwargs.pop(run_binding.META, None))
        try:
            return await original(self, prompt, session_id, *args, **kwargs)
        finally:
            run_binding.leave(session_id, mark)
    agent.prompt = prompt


#: what a restored ACP session would take from its ``state.db`` row instead of the config
_RESTORED = ("model", "requested_provider", "base_url", "api_mode")


def _config_model_only(module):
    manager = getattr(module, "SessionManager", None)
    original = getattr(manager, "_make_agent", None)
    if manager is None or original is None:
        return

    @functools.wraps(original)
    def _make_agent(self, *args, **kwargs):
        for name in _RESTORED:
            kwargs.pop(name, None)
        return original(self, *args, **kwargs)
    manager._make_agent = _make_agent


def _no_file_drop(_user_input):
    return None


def _patch_cli(module):
    if hasattr(module, "_detect_file_drop"):
        module._detect_file_drop = _no_file_drop


def _approval_timeout():
    try:
        value = float(os.environ.get("HERMES_SERVICE_APPROVAL_TIMEOUT", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _with_timeout(module, name):
    timeout = _approval_timeout()
    original = getattr(module, name, None)
    if timeout is None or original is None:
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        kwargs.setdefault("timeout", timeout)
        return original(*args, **kwargs)
    setattr(module, name, wrapper)


#: ACP session id -> (its connection, the connection's loop), from make_approval_callback
_CHANNELS: dict = {}
_CLARIFY_METHOD = "hermes_service/clarify"
_NO_ANSWER = ("The user did not provide a response within the time limit. "
              "Use your best judgement to make the choice and proceed.")   # Hermes's cli.py


def _clarify_enabled():
    return os.environ.get("HERMES_SERVICE_CLARIFY") == "1"


def _remember_channel(module):
    """Wrap make_approval_callback to note each prompt's connection and loop (then patch its
    timeout as for every service ACP process)."""
    original = getattr(module, "make_approval_callback", None)
    if original is not None and _clarify_enabled():
        @functools.wraps(original)
        def remember(request_permission_fn, loop, session_id, *args, **kwargs):
            conn = getattr(request_permission_fn, "__self__", None)
            if conn is not None:
                _CHANNELS[session_id] = (conn, loop)
            return original(request_permission_fn, loop, session_id, *args, **kwargs)
        module.make_approval_callback = remember
    _with_timeout(module, "make_approval_callback")


def _current_session():
    try:
        from tools.approval import get_current_session_key
        key = get_current_session_key(default="")
    except Exception:      # noqa: BLE001 - fall back to the adapter's process variable
        key = ""
    return key if key in _CHANNELS else os.environ.get("HERMES_SESSION_ID", "")


def _ask_client(question, choices):
    import asyncio
    session_id = _current_session()
    conn, loop = _CHANNELS[session_id]
    future = asyncio.run_coroutine_threadsafe(conn.ext_method(_CLARIFY_METHOD, {
        "sessionId": session_id, "question": question, "choices": choices}), loop)
    try:
        reply = future.result(timeout=_approval_timeout() or 60.0)
    except Exception:  # noqa: BLE001 - no answer (timeout, closed connection, error reply)
        future.cancel()
        return _NO_ANSWER
    reply = reply if isinstance(reply, dict) else {}
    if reply.get("unavailable"):      # the tool then answers "Failed to get user input: …"
        raise RuntimeError("nobody can be asked in this run")
    answer = reply.get("answer")
    return _NO_ANSWER if answer is None else str(answer)


def _patch_clarify(module):
    original = getattr(module, "clarify_tool", None)
    if original is None or not _clarify_enabled():
        return

    @functools.wraps(original)
    def clarify_tool(question, choices=None, callback=None):
        if callback is None and _current_session() in _CHANNELS:
            callback = _ask_client
        return original(question, choices=choices, callback=callback)
    module.clarify_tool = clarify_tool


def _tool_names(module):
    import toolcalls  # this folder is on the path (PYTHONPATH's)
    toolcalls.patch(module)


def _approvals(module):
    if _approval_timeout() is not None and hasattr(module, "save_permanent_allowlist"):
        module.save_permanent_allowlist = lambda patterns: None
    # nobody to ask in this process's turns: refuse at once, saying who refused
    if os.environ.get(unattended.ENV) == "deny":
        unattended.patch(module, os.environ.get(unattended.ROUTE_ENV))


class _InlineThreading:
    """``threading`` for ``agent.title_generator``: its one ``Thread`` runs its target in the
    caller's thread at ``start()`` (see :func:`_titles_in_turn`)."""

    class Thread:
        def __init__(self, target=None, args=(), kwargs=None, **_kw):
            self._run = (target, args, kwargs or {})

        def start(self):
            target, args, kwargs = self._run
            if target is not None:
                target(*args, **kwargs)


def _titles_in_turn(module):
    """An ACP session's title is made before its prompt answers, not in a thread after it:
    its model call then belongs to the turn that caused it (the turn's usage, its log line:
    docs/runners.md §One usage truth)."""
    module.threading = _InlineThreading


#: module name -> what to do to it once it has been executed
_PATCHES = {
    "agent.title_generator": _titles_in_turn,
    "cli": _patch_cli,
    # main() imports the name at call time: the module attribute is what it gets
    "hermes_cli.config": _no_container_mode,
    # server.py imports the name at its import: patch permissions before server runs
    "acp_adapter.permissions": _remember_channel,
    # imported at call time by server.py: the module attribute is what it gets
    "acp_adapter.edit_approval": lambda m: _with_timeout(m, "make_acp_edit_approval_requester"),
    "tools.approval": _approvals,
    "tools.clarify_tool": _patch_clarify,
    # imported by name by acp_adapter.events and .server: patch it before they run
    "acp_adapter.tools": _tool_names,
    # the router looks the method up on the agent when the connection is made
    "acp_adapter.server": _bind_runs,
    "acp_adapter.session": _config_model_only,
}


class _PatchCli(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the modules in :data:`_PATCHES`."""

    def find_spec(self, name, path=None, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_patch(module):
            exec_module(module)
            patch(module)
        loader.exec_module = exec_and_patch  # type: ignore[method-assign,union-attr]
        return spec


# this folder is on the path (PYTHONPATH's): its modules import by their own names
import run_binding  # noqa: E402
import unattended  # noqa: E402

run_binding.take_env()          # first: no process Hermes starts may inherit it
sys.meta_path.insert(0, _PatchCli())
_guard()
# a sandbox with a network of its own: its loopback ports to the service's sockets, bound
# before Hermes's code runs (netforward.py; nothing without HERMES_SERVICE_FORWARD)
import netforward  # noqa: E402

netforward.start()
netforward.proxy_for_children_only()

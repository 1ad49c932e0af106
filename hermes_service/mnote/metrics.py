"""The mnote extension's Prometheus metrics (docs/operations.md#metrics), on the service's
:data:`~hermes_service.metrics.REGISTRY` under its namespace, next to the core's:

* :func:`tool_call` — one call on the mnote tool endpoint;
* :func:`kernel_call` / :func:`kernel_retry` — one tool call sent to mnote's kernel
  (``mnote.page_store.kind: command | http``) and its retries;
* :func:`approval_asked` / :func:`approval_answered` — questions put to the panel's user
  (docs/mnote-client.md#approvals) and how each was resolved;
* :func:`stream_opened` / :func:`stream_closed` — event streams open now;
* :func:`run_interrupted` — a run of a dead service process closed with ``run_interrupted``;
* :func:`watch_runs` — the gauges read at scrape time from the run manager (runs active,
  event-stream slots).

As in :mod:`hermes_service.metrics`, only these functions choose label values, so no caller
can put a user id, message text or key into a label.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ..metrics import NAMESPACE, REGISTRY, declare_watched, watch

APPROVAL_KINDS = frozenset({"command", "edit", "other", "clarify"})
APPROVAL_RESOLUTIONS = frozenset({"user", "timeout", "abort"})
APPROVAL_CHOICES = frozenset({"once", "session", "always", "deny",   # approvals
                              "answer", "none"})                     # clarify: answered or not
APPROVALS_ASKED = Counter(
    "approvals_asked", "Questions Hermes asked the panel's user (approval.request, "
    "clarify.request), by kind (command, edit, other, clarify).", ["kind"],
    namespace=NAMESPACE, registry=REGISTRY)
APPROVALS_ANSWERED = Counter(
    "approvals_answered", "Questions resolved (approval.responded, clarify.responded), by "
    "resolution (user, timeout, abort) and choice (once, session, always, deny; clarify: "
    "answer, none).",
    ["resolved_by", "choice"],
    namespace=NAMESPACE, registry=REGISTRY)
TOOL_CALLS = Counter(
    "tool_calls", "Calls on the mnote tool endpoint, by tool (contract name; 'unknown' for "
    "any other) and outcome (ok, or the envelope's error code).", ["tool", "outcome"],
    namespace=NAMESPACE, registry=REGISTRY)
KERNEL_TRANSPORTS = frozenset({"http", "command"})
KERNEL_CALLS = Counter(
    "kernel_calls", "Tool calls sent to mnote's kernel (mnote.page_store.kind command or http), "
    "by transport and outcome: ok (a valid envelope, ok true or false) or why there was no usable "
    "answer (unreachable, timeout, unauthorized, http_status, exit_status, too_large, bad_answer, "
    "wrong_call, tls, busy).", ["transport", "outcome"], namespace=NAMESPACE, registry=REGISTRY)
KERNEL_RETRIES = Counter(
    "kernel_retries", "Further attempts of a kernel call after a transport failure (same "
    "envelope, same idempotencyKey), by transport.", ["transport"], namespace=NAMESPACE,
    registry=REGISTRY)
KERNEL_SECONDS = Histogram(
    "kernel_call_duration_seconds", "A kernel call's time, retries included, any outcome, by "
    "transport.", ["transport"], namespace=NAMESPACE, registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50))
RUNS_INTERRUPTED = Counter(
    "runs_interrupted", "Runs closed with run.failed run_interrupted (client code "
    "hermes_client_run_interrupted) because the service process running them was gone (crash, "
    "kill -9): counted by the process that closed them.", namespace=NAMESPACE, registry=REGISTRY)
EVENT_STREAMS = Gauge(
    "event_streams_open", "Server-Sent Events streams open now (at most "
    "mnote.max_event_streams).", namespace=NAMESPACE, registry=REGISTRY)
declare_watched("runs_active", "mnote runs queued or running now.")
declare_watched("event_streams_max", "Event-stream slots (mnote.max_event_streams): "
                "event_streams_open can reach this, then streams get 429.")


def tool_call(tool, outcome: str | None) -> None:
    """One tool-endpoint call. ``tool``: the envelope's ``toolName`` (anything not a known
    contract tool name is counted as ``unknown``); ``outcome``: None/``ok`` or an error code
    (a code outside :data:`~.tools.ERROR_CODES`, e.g. a kernel's own, is counted as
    ``other``)."""
    from .tools import ERROR_CODES, TOOLS_BY_NAME
    name = tool if isinstance(tool, str) and tool in TOOLS_BY_NAME else "unknown"
    TOOL_CALLS.labels(name, "ok" if not outcome else outcome if outcome in ERROR_CODES
                      else "other").inc()


def kernel_call(transport: str, outcome: str, seconds: float) -> None:
    """One call sent to the kernel: ``outcome`` ``ok`` or a
    :data:`~.kernel_wire.REASONS` key; ``seconds`` with its retries."""
    from .kernel.wire import REASONS
    if transport in KERNEL_TRANSPORTS and (outcome == "ok" or outcome in REASONS):
        KERNEL_CALLS.labels(transport, outcome).inc()
        KERNEL_SECONDS.labels(transport).observe(seconds)


def kernel_retry(transport: str) -> None:
    """A further attempt after a transport failure."""
    if transport in KERNEL_TRANSPORTS:
        KERNEL_RETRIES.labels(transport).inc()


def approval_asked(kind: str) -> None:
    """One question put to the user; ``kind`` outside :data:`APPROVAL_KINDS` counts as other."""
    APPROVALS_ASKED.labels(kind if kind in APPROVAL_KINDS else "other").inc()


def approval_answered(resolved_by: str, choice: str) -> None:
    """One question resolved (label values outside the known sets are not counted)."""
    if resolved_by in APPROVAL_RESOLUTIONS and choice in APPROVAL_CHOICES:
        APPROVALS_ANSWERED.labels(resolved_by, choice).inc()


def run_interrupted() -> None:
    """A run of a dead service process was closed (``hermes_service_runs_interrupted_total``;
    docs/data-and-durability.md#runs-and-their-events)."""
    RUNS_INTERRUPTED.inc()


def stream_opened() -> None:
    """An event stream took its slot."""
    EVENT_STREAMS.inc()


def stream_closed() -> None:
    """An event stream gave its slot back (call exactly once per :func:`stream_opened`)."""
    EVENT_STREAMS.dec()


def watch_runs(runs) -> None:
    """Report ``runs`` (a :class:`~hermes_service.mnote.runs.manager.RunManager`) at every scrape:
    ``hermes_service_runs_active`` and ``hermes_service_event_streams_max``."""
    watch("runs_active", runs.active)
    watch("event_streams_max", lambda: runs.streams.size)

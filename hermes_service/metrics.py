"""Prometheus metrics (docs/operations.md §Metrics), served at ``GET /metrics``
(:mod:`hermes_service.web.ops`).

The rest of the service reports through the small functions below, one call per event;
this module owns every metric, its labels and the label-value rules, so no caller can put a
user id, message text or key into a label:

* :func:`http_request` — one finished HTTP request (called by the access-log hook);
* :class:`TurnClock` / :func:`turn_finished` — one turn of a runner (queue wait, duration,
  outcome code);
* :func:`model_request` / :func:`model_tokens` — one request on the model pass-through
  endpoint (``model_proxy/``) and the tokens the provider reported for it;
* :func:`set_draining` — the process drains before it stops;
* :func:`watch` — gauges read at scrape time from a callback (processes, registry size);
  :func:`declare_watched` adds such a gauge (an extension's).

An extension defines its own instruments on :data:`REGISTRY` under :data:`NAMESPACE`.

Metrics live in their own :data:`REGISTRY` (plus the standard ``process_*`` and
``python_*`` collectors), one per service process; scrape every process. Units are
seconds (Prometheus naming conventions). This module holds the instruments only and imports
nothing of the web layer; the route is :func:`hermes_service.web.ops.metrics`.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from . import logs

NAMESPACE = "hermes_service"
UNMATCHED_ROUTE = "(unmatched)"        # 404/405 before routing: the raw path is never a label
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

disable_created_metrics()     # no *_created series: Prometheus does not need them
REGISTRY = CollectorRegistry(auto_describe=True)
# process_resident_memory_bytes, process_cpu_seconds_total, …
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# Turns last seconds to minutes (one CLI turn ≈ 3–7 s on a scripted model; limit 300 s).
TURN_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

HTTP_REQUESTS = Counter(
    "http_requests", "HTTP requests answered, by route template (never the raw path), "
    "method and status code.", ["route", "method", "status"], namespace=NAMESPACE,
    registry=REGISTRY)
HTTP_DURATION = Histogram(
    "http_request_duration_seconds", "Time to the response headers, by route template "
    "(an event stream counts until its headers are sent).", ["route", "method"],
    namespace=NAMESPACE, buckets=HTTP_BUCKETS, registry=REGISTRY)
TURNS = Counter(
    "turns", "Turns that reached a runner, by runner (cli | acp), route family (v1, or the "
    "name of an extension's family) and outcome (ok, or the core error code, e.g. "
    "upstream_unavailable, run_cancelled, too_many_runs).", ["runner", "family", "outcome"],
    namespace=NAMESPACE, registry=REGISTRY)
TURN_DURATION = Histogram(
    "turn_duration_seconds", "From the runner starting the turn (CLI spawned) to its end, any "
    "outcome.", ["runner", "family"], namespace=NAMESPACE, buckets=TURN_BUCKETS,
    registry=REGISTRY)
TURN_QUEUE_WAIT = Histogram(
    "turn_queue_wait_seconds", "From the turn holding its session to the runner starting it "
    "(waiting for a CLI slot); a turn refused or aborted while waiting counts its whole wait.",
    ["runner", "family"], namespace=NAMESPACE, buckets=WAIT_BUCKETS, registry=REGISTRY)
MODEL_TOKENS = Counter(
    "model_tokens", "Model tokens of requests through the model pass-through endpoint, by "
    "kind (prompt | completion): the provider's own usage fields, or the pass-through's "
    "estimate when the provider reported none (model_tokens_estimated counts that part).",
    ["kind"], namespace=NAMESPACE, registry=REGISTRY)
MODEL_TOKENS_ESTIMATED = Counter(
    "model_tokens_estimated", "The part of model_tokens the pass-through estimated (a stream "
    "cut before its usage chunk, an answer without usage): prompt = a quarter of the "
    "request's bytes, completion = a quarter of the answer's characters.",
    ["kind"], namespace=NAMESPACE, registry=REGISTRY)
EGRESS_CONNECTIONS = Counter(
    "egress_connections", "Connections of sandboxed tools through the egress proxy, by outcome: "
    "ok, or the refusal's reason (not_allowed, denied, ip_literal, denied_address, "
    "unresolvable, lookup_busy, lookup_timeout, bad_request, host_mismatch, length_required, "
    "unreachable; docs/sandbox.md §Network).", ["outcome"],
    namespace=NAMESPACE, registry=REGISTRY)
SANDBOX_REFUSED = Counter(
    "sandbox_requests_refused", "Requests from inside a sandbox to this service refused before "
    "any route, by reason: not_a_sandbox_route, bad_request, length_required, unreachable "
    "(docs/sandbox.md §Network).", ["reason"], namespace=NAMESPACE, registry=REGISTRY)
EGRESS_BYTES = Counter(
    "egress_bytes", "Bytes through the egress proxy, by direction: up (sandbox to the "
    "internet) or down.", ["direction"], namespace=NAMESPACE, registry=REGISTRY)
MODEL_REQUESTS = Counter(
    "model_requests", "Requests of Hermes processes on the model pass-through endpoint, by "
    "outcome: ok (provider status < 400), provider_error (the provider's 4xx/5xx, passed "
    "through), unreachable (502/504 from the endpoint itself), unauthorized (unknown or "
    "revoked credential, never forwarded), refused (answered by the endpoint itself: a "
    "method, field, model, size or header it does not forward, a spent token budget; never "
    "forwarded). Unknown paths (Hermes's own local-server probes) are not counted.",
    ["outcome"], namespace=NAMESPACE, registry=REGISTRY)
MODEL_OUTCOMES = frozenset({"ok", "provider_error", "unreachable", "unauthorized", "refused"})
DRAINING = Gauge(
    "draining", "1 while this process drains (after SIGTERM/Ctrl-C: no new turns, running "
    "ones finish for up to service.drain_seconds), else 0.", namespace=NAMESPACE,
    registry=REGISTRY)


class _Watched:
    """Gauges whose value a callback gives at scrape time (see :func:`watch`)."""

    HELP: ClassVar[dict[str, tuple[str, list[str]]]] = {
        "runner_processes": ("Runner processes (Hermes CLI / ACP) running now, by runner.",
                             ["runner"]),
        "registry_sessions": ("Session records in the session registry (sessions.json).", []),
    }

    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: dict[tuple[str, tuple], Callable[[], float]] = {}

    def declare(self, name: str, text: str, labels: Sequence[str]) -> None:
        with self._lock:
            self.HELP[name] = (text, list(labels))

    def set(self, name: str, labels: dict, fn: Callable[[], float]) -> None:
        if name not in self.HELP or sorted(labels) != sorted(self.HELP[name][1]):
            raise ValueError(f"unknown watched gauge {name} {sorted(labels)}")
        with self._lock:
            self._callbacks[(name, tuple(labels[k] for k in self.HELP[name][1]))] = fn

    def describe(self):
        return [GaugeMetricFamily(f"{NAMESPACE}_{name}", text, labels=labels)
                for name, (text, labels) in self.HELP.items()]

    def collect(self):
        with self._lock:
            callbacks = dict(self._callbacks)
        families = {name: GaugeMetricFamily(f"{NAMESPACE}_{name}", text, labels=labels)
                    for name, (text, labels) in self.HELP.items()}
        for (name, values), fn in callbacks.items():
            try:
                families[name].add_metric(list(values), float(fn()))
            except Exception:  # noqa: BLE001 - a broken callback must not break the scrape
                continue
        return [f for f in families.values() if f.samples]


_WATCHED = _Watched()
REGISTRY.register(_WATCHED)


class _LogDrops:
    """``hermes_service_log_lines_dropped_total``: log lines the log writer dropped because
    its queue stayed full (:class:`hermes_service.logs.LineHandler`), read at scrape time."""

    NAME, HELP = f"{NAMESPACE}_log_lines_dropped", (
        "Log lines dropped because the log stream did not keep up (the writer's queue stayed "
        "full); each drop is also reported in the log once the writer catches up.")

    def describe(self):
        return [CounterMetricFamily(self.NAME, self.HELP)]

    def collect(self):
        return [CounterMetricFamily(self.NAME, self.HELP, value=logs.dropped_lines())]


REGISTRY.register(_LogDrops())


def watch(name: str, fn: Callable[[], float], **labels: str) -> None:
    """Report ``fn()`` as gauge ``hermes_service_<name>`` at every scrape.

    ``name``: ``runner_processes`` (label ``runner``), ``registry_sessions``, or one
    :func:`declare_watched` added. A later call with the same name and labels replaces the callback
    (the newest app of a process wins). Raises ValueError for an unknown name or label set.
    """
    _WATCHED.set(name, labels, fn)


def declare_watched(name: str, text: str, labels: tuple[str, ...] = ()) -> None:
    """Add gauge ``hermes_service_<name>`` (help ``text``, ``labels``) to those :func:`watch`
    accepts (idempotent)."""
    _WATCHED.declare(name, text, labels)


# -- events ------------------------------------------------------------------------
# (route, method, status) -> the two children of that series: ``labels()`` validates and
# locks on every call; the series of a label set never change, so each is looked up once
_HTTP_SERIES: dict[tuple, tuple] = {}


def http_request(route: str | None, method: str, status: int, seconds: float) -> None:
    """One answered request. ``route``: the Flask rule (``request.url_rule.rule``), None if
    no route matched; ``seconds``: time to the response headers."""
    key = (route, method, status)
    series = _HTTP_SERIES.get(key)
    if series is None:
        route = route or UNMATCHED_ROUTE
        method = method if method in HTTP_METHODS else "other"
        series = (HTTP_REQUESTS.labels(route, method, str(int(status))),
                  HTTP_DURATION.labels(route, method))
        if len(_HTTP_SERIES) < 10000:   # bounded whatever callers pass
            _HTTP_SERIES[key] = series
    series[0].inc()
    series[1].observe(max(0.0, seconds))


def turn_finished(runner: str, family: str, outcome: str, seconds: float | None,
                  queue_wait: float) -> None:
    """One finished turn. ``outcome``: ``ok`` or a core error code; ``seconds``: its running
    time, None if the runner never started it (refused or aborted while queued);
    ``queue_wait``: seconds until it started (or gave up)."""
    TURNS.labels(runner, family, outcome).inc()
    TURN_QUEUE_WAIT.labels(runner, family).observe(max(0.0, queue_wait))
    if seconds is not None:
        TURN_DURATION.labels(runner, family).observe(max(0.0, seconds))


class TurnClock:
    """Times one turn for :func:`turn_finished`: create it when the turn holds its session, call
    :meth:`started` when the runner starts it (idempotent: a retried spawn keeps the first
    time), and :meth:`finished` once with the outcome."""

    def __init__(self, runner: str, family: str | None):
        self.runner, self.family = runner, family or "other"
        self.asked = time.monotonic()
        self.begun: float | None = None
        self._done = False

    def started(self) -> None:
        if self.begun is None:
            self.begun = time.monotonic()

    def on_spawn(self, then: Callable | None = None) -> Callable:
        """A runner ``on_spawn`` callback that marks the start, then calls ``then(proc)``."""
        def hook(proc):
            self.started()
            if then is not None:
                then(proc)
        return hook

    def finished(self, outcome: str) -> None:
        if self._done:
            return
        self._done = True
        now = time.monotonic()
        began = self.begun
        turn_finished(self.runner, self.family, outcome, None if began is None else now - began,
                      (began if began is not None else now) - self.asked)


def model_tokens(prompt: int, completion: int) -> None:
    """Tokens of one model request, as the provider's ``usage`` reported them (0: none)."""
    if prompt > 0:
        MODEL_TOKENS.labels("prompt").inc(prompt)
    if completion > 0:
        MODEL_TOKENS.labels("completion").inc(completion)


def sandbox_request_refused(reason: str) -> None:
    """A request from inside a sandbox to this service refused before it reached a route."""
    SANDBOX_REFUSED.labels(reason).inc()


def model_tokens_estimated(prompt: int, completion: int) -> None:
    """Tokens of one model request the pass-through estimated (also in :func:`model_tokens`)."""
    if prompt > 0:
        MODEL_TOKENS_ESTIMATED.labels("prompt").inc(prompt)
    if completion > 0:
        MODEL_TOKENS_ESTIMATED.labels("completion").inc(completion)


def egress_connection(outcome: str, up: int, down: int) -> None:
    """One finished egress proxy connection (``outcome``: ok or a refusal reason)."""
    EGRESS_CONNECTIONS.labels(outcome).inc()
    if up:
        EGRESS_BYTES.labels("up").inc(up)
    if down:
        EGRESS_BYTES.labels("down").inc(down)


def model_request(outcome: str) -> None:
    """One request on the model pass-through endpoint; ``outcome`` one of
    :data:`MODEL_OUTCOMES` (anything else raises ValueError)."""
    if outcome not in MODEL_OUTCOMES:
        raise ValueError(f"unknown model request outcome {outcome!r}")
    MODEL_REQUESTS.labels(outcome).inc()


def set_draining(on: bool) -> None:
    """The process started (True) or ended (False) a drain (docs/operations.md §Process
    lifetime)."""
    DRAINING.set(1 if on else 0)



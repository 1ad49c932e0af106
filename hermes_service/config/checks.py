"""The core's cross-key checks of a config (docs/configuring.md): each reads a resolved
:class:`~.model.Config` and returns its ``file:key: problem`` lines; it is skipped when the
file gave one of the keys it ``reads`` invalidly (the file's other problems are still
found). They run in this order, after the schema's problems and those of resolving the
values; then the extension sections' own (:attr:`~.model.ConfigSection.checks`)."""
from __future__ import annotations

from .. import sandbox
from .model import SPARE_CONNECTIONS, Check, Config

#: Hermes refuses a context window below this (agent/model_metadata.py MINIMUM_CONTEXT_LENGTH).
HERMES_MIN_CONTEXT_LENGTH = 64000
#: A session mapping used within the last hour is never removed by retention.
MIN_SESSION_AGE_SECONDS = 3600

CHECKS: list[Check] = []


def _check(*reads: str):
    def register(fn):
        CHECKS.append(Check(fn.__name__, reads, fn))
        return fn
    return register


@_check("security.enable_api_key", "security.api_keys")
def api_keys_configured(cfg: Config) -> list[str]:
    if cfg.security.enable_api_key and not cfg.security.key_entries:
        return [f"{cfg.source}:security.api_keys: enable_api_key is true but no key is "
                "configured (run `.venv/bin/python main.py keygen`)"]
    return []


@_check("cors.allow_credentials", "cors.allow_origins")
def cors_credentials(cfg: Config) -> list[str]:
    if cfg.cors.allow_credentials and "*" in cfg.cors.allow_origins:
        return [f"{cfg.source}:cors.allow_origins: '*' cannot be combined with "
                "allow_credentials: true; list the origins"]
    return []


@_check("service.threads", "hermes.max_concurrent_runs", "hermes.max_waiting_requests")
def enough_threads(cfg: Config) -> list[str]:
    needs = [need for need, _n in cfg.thread_needs]
    if not cfg.valid(*(need.key for need in needs)):
        return []
    threads, needed = cfg.service.threads, cfg.threads_needed
    if threads < needed:
        holders = [need.what for need in needs] + ["v1 turns (running and waiting)", "tool calls"]
        terms = [need.key for need in needs] + ["2 * hermes.max_concurrent_runs",
                                                "hermes.max_waiting_requests", "4"]
        return [f"{cfg.source}:service.threads: {threads} is too few; "
                f"{', '.join(holders[:-1])} and {holders[-1]} each hold a thread "
                f"(need >= {needed} = {' + '.join(terms)})"]
    return []


@_check("service.connection_limit", "service.threads")
def enough_connections(cfg: Config) -> list[str]:
    limit, threads = cfg.service.connection_limit, cfg.service.threads
    if limit < cfg.connections_needed:
        held = " and ".join(f"the {n} of {need.key}" for need, n in cfg.thread_needs)
        return [f"{cfg.source}:service.connection_limit: {limit} is too few; every thread "
                f"(service.threads: {threads}{', which includes ' + held if held else ''}) "
                "can hold one, and idle or queued connections need room beyond them (need >= "
                f"{cfg.connections_needed} = service.threads + {SPARE_CONNECTIONS})"]
    return []


@_check("hermes.model.context_length")
def context_length(cfg: Config) -> list[str]:
    ctx_len = cfg.hermes.model.context_length
    if ctx_len < HERMES_MIN_CONTEXT_LENGTH:
        return [f"{cfg.source}:hermes.model.context_length: {ctx_len} is below Hermes's minimum "
                f"of {HERMES_MIN_CONTEXT_LENGTH} tokens (Hermes refuses to run with less: "
                "every turn would fail)"]
    return []


@_check("storage.url")
def storage_url(cfg: Config) -> list[str]:
    """``storage.url``: a ``postgresql://`` (or ``postgres://``) URL without a password; the
    problem never repeats the URL (it may hold one)."""
    url = cfg.storage.url
    if url is None:
        return []
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return [f"{cfg.source}:storage.url: not a URL (postgresql://user@host:port/database)"]
    if parts.scheme not in ("postgresql", "postgres"):
        return [f"{cfg.source}:storage.url: must start with postgresql:// "
                "(postgresql://user@host:port/database)"]
    if has_password or "password=" in (parts.query or ""):
        return [f"{cfg.source}:storage.url: holds a password; put it in the environment "
                "variable storage.password_env names, never in this file"]
    return []


@_check("retention.interval_seconds")
def retention_interval(cfg: Config) -> list[str]:
    interval = cfg.retention.interval_seconds
    if 0 < interval < 60:
        return [f"{cfg.source}:retention.interval_seconds: {interval} is too "
                "short; use 0 (no periodic cleanup) or at least 60"]
    return []


@_check("retention.sessions_older_than")
def session_age(cfg: Config) -> list[str]:
    older = cfg.retention.sessions_older_than_seconds
    if older is not None and older < MIN_SESSION_AGE_SECONDS:
        return [f"{cfg.source}:retention.sessions_older_than: must be at least 1h (a mapping "
                "used within the last hour is never removed)"]
    return []


@_check("retention.idempotency_window_seconds", "hermes.timeout_seconds")
def tool_retry_window(cfg: Config) -> list[str]:
    timeout = cfg.hermes.timeout_seconds
    if cfg.retention.idempotency_window_seconds < timeout:
        return [f"{cfg.source}:retention.idempotency_window_seconds: must be at least "
                f"hermes.timeout_seconds ({timeout}): a run's retries must "
                "find their first response"]
    return []


@_check("service.idempotency_ttl_seconds", "hermes.timeout_seconds", "hermes.queue_wait_seconds")
def idempotency_ttl(cfg: Config) -> list[str]:
    longest = cfg.hermes.longest_turn_seconds
    if cfg.service.idempotency_ttl_seconds < longest:
        return [f"{cfg.source}:service.idempotency_ttl_seconds: must be at least "
                f"hermes.queue_wait_seconds + hermes.timeout_seconds "
                f"({longest}): a retry must find "
                "the outcome of a turn that took as long as a turn may (docs/v1-api.md "
                "§Idempotent retries)"]
    return []


@_check("hermes.sandbox", "hermes.toolsets")
def sandbox_toolsets(cfg: Config) -> list[str]:
    return sandbox.problems(cfg.hermes.sandbox, list(cfg.hermes.toolsets), cfg.source)


@_check()
def execute_not_chat(cfg: Config) -> list[str]:
    return [f"{cfg.source}:hermes.execute.allowed.{i}: 'chat' is not allowed here; "
            "use the sessions API"
            for i, argv in enumerate(cfg.hermes.execute.allowed)
            if cfg.valid(f"hermes.execute.allowed.{i}") and argv and argv[0] == "chat"]


@_check("hermes.approvals.unattended")
def unattended_families(cfg: Config) -> list[str]:
    """Each name of ``hermes.approvals.unattended`` is a route family whose turns run here:
    ``v1`` or an installed extension's (its section's name); a typo would leave ``deny``."""
    known = {"v1", *(s.name for s in cfg.extension_sections)}
    return [f"{cfg.source}:hermes.approvals.unattended.{name}: not a route family of this "
            f"service (one of {', '.join(sorted(known))})"
            for name in cfg.hermes.approvals.unattended if name not in known]


def run_checks(cfg: Config) -> list[str]:
    """The problems of every :data:`CHECKS` entry whose keys validated, in order, then of the
    checks of ``cfg``'s extension sections (:attr:`ConfigSection.checks`)."""
    checks = [*CHECKS, *(c for s in cfg.extension_sections for c in s.checks)]
    return [p for check in checks if cfg.valid(*check.reads) for p in check.run(cfg)]

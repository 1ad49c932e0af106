"""Failure classification: how a turn that failed becomes a stable error code
(docs/runners.md, §Errors). A killed process maps by why it was killed (:data:`KILLED`); otherwise
Hermes's own failure text — CLI stdout/stderr or an ACP reply — is matched
(:func:`classify_text`) and logged, never returned (:func:`failure_reason`).
"""
from __future__ import annotations

import re

from ..errors import RunError, ServiceError, Unconfigured
from ..model_proxy.usage import BUDGET_MARK, budget_error
from .processes import Outcome

#: the line `hermes chat -Q` ends its output with, naming the Hermes session
SESSION_LINE = re.compile(r"^session_id:\s*(\S+)\s*$")


KILLED = {   # why we ended a process group -> (status, code, detail)
    "timeout": (504, "run_timeout", "the Hermes run exceeded its time limit and was killed"),
    "stall": (504, "run_stalled",
              "the Hermes run produced no output or tool activity and was killed"),
    "cancelled": (409, "run_cancelled", "the run was aborted"),
    "shutdown": (503, "service_stopping", "the service is shutting down; retry"),
    "limit": (422, "run_limit_exceeded", "the Hermes run exceeded a limit of its sandbox"),
    # the listener's output budget (a client run's events: docs/mnote-client.md §Sizes of events)
    "output": (422, "run_limit_exceeded", "the run's output passed its size limit and the "
                                          "run was ended"),
}
#: The limit names of ``run_limit_exceeded`` (``hermes.sandbox.limits``), for its detail.
LIMIT_NAMES = {"memory": "memory (hermes.sandbox.limits.memory_mb)",
               "processes": "processes (hermes.sandbox.limits.processes)",
               "cpu": "CPU time (hermes.sandbox.limits.cpu_seconds)",
               "file_size": "file size (hermes.sandbox.limits.file_size_mb)"}


def limit_error(which: str | None) -> RunError:
    """``run_limit_exceeded`` (422) naming the limit (docs/sandbox.md); the disk watcher's
    ``home_quota`` is ``home_quota_exceeded`` (507), its ``disk`` ``storage_full`` (507)."""
    if which == "home_quota":
        return RunError("the user's home grew past its quota (hermes.sandbox.max_home_mb) "
                        "during the turn and the turn was ended; delete files from it (an "
                        "operator: hermes-service home-trim <user_id>)",
                        code="home_quota_exceeded", status=507)
    if which == "disk":
        return RunError("the disk fell below hermes.sandbox.min_free_mb while this turn "
                        "wrote to it, and the turn was ended", code="storage_full", status=507)
    status, code, detail = KILLED["limit"]
    if which in LIMIT_NAMES:
        detail = f"the Hermes run exceeded its sandbox's {LIMIT_NAMES[which]} and was ended"
    return RunError(detail, code=code, status=status)


def classify_failure(outcome: Outcome) -> ServiceError:
    """Map a failed CLI run to a :class:`ServiceError` with a stable code.

    =====================  ======  ================================================
    code                   status  cause (text Hermes prints, rc != 0)
    =====================  ======  ================================================
    run_timeout            504     our own ``hermes.timeout_seconds`` ran out
    run_stalled            504     no output/tool activity for stall_timeout_seconds
    run_cancelled          409     aborted by a client
    service_stopping       503     the service shut down during the turn
    run_limit_exceeded     422     a sandbox limit (memory, processes, CPU, file size)
    (others)                       see :func:`classify_text`
    =====================  ======  ================================================
    """
    if outcome.killed == "limit":
        return limit_error(outcome.limit)
    if outcome.killed in KILLED:
        status, code, detail = KILLED[outcome.killed]
        return RunError(detail, code=code, status=status,
                        headers={"Retry-After": "5"} if code == "service_stopping" else None)
    if re.search(r"Session not found", outcome.stderr):
        return RunError("unknown Hermes session", code="session_not_found", status=404)
    err = classify_text(outcome.stdout + "\n" + outcome.stderr)
    if err.code == "hermes_failed":
        err.detail = f"the Hermes CLI failed (exit code {outcome.returncode})"
    return err


def classify_text(text: str) -> ServiceError:
    """Map Hermes's own failure text (CLI stdout/stderr, or an ACP reply) to a stable code.

    =====================  ======  ================================================
    code                   status  cause
    =====================  ======  ================================================
    upstream_unauthorized  502     provider answered HTTP 401/403
    token_budget_exceeded  429     the user's hermes.limits.daily_tokens are spent (the
                                   pass-through's 429; Retry-After: to 00:00 UTC)
    upstream_rate_limited  503     provider answered HTTP 429 (Retry-After set)
    upstream_unavailable   502     connection error, provider 5xx or timeout
    hermes_unconfigured    503     no provider configured, or Hermes refused the
                                   configuration (e.g. context_length < 64 000)
    hermes_failed          502     anything else (the text is logged, not returned)
    =====================  ======  ================================================
    """
    if re.search(r"HTTP 40[13]\b|\b401\b.*(unauthori[sz]ed|invalid api key)|AuthenticationError",
                 text, re.I):
        return RunError("the model provider rejected the service's credentials",
                        code="upstream_unauthorized", status=502)
    if BUDGET_MARK in text:
        return budget_error()
    if re.search(r"HTTP 429\b|RateLimitError|rate limit", text, re.I):
        return RunError("the model provider is rate limiting requests",
                        code="upstream_rate_limited", status=503, headers={"Retry-After": "30"})
    if re.search(r"HTTP 5\d\d\b|Connection error|APIConnectionError|timed out|timeout|"
                 r"InternalServerError|ServiceUnavailable|Bad Gateway", text, re.I):
        return RunError("the model provider is unreachable or failing", code="upstream_unavailable",
                        status=502)
    if re.search(r"Failed to initiali[sz]e agent", text):
        return Unconfigured("Hermes refused the model configuration (see the service log)",
                            code="hermes_unconfigured")
    if re.search(r"no (inference )?provider|not configured|hermes setup|hermes model", text, re.I):
        return Unconfigured("no model provider is configured for Hermes",
                            code="hermes_unconfigured")
    return RunError("the Hermes agent failed", code="hermes_failed", status=502)


def failure_reason(text: str, limit: int = 500) -> str:
    """Hermes's own failure text for the log: its non-blank lines, the ``session_id`` line
    dropped, joined on one line and cut at ``limit`` characters."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not SESSION_LINE.match(ln.strip())]
    reason = " | ".join(lines)
    return reason if len(reason) <= limit else reason[:limit] + "…"


def empty_answer() -> RunError:
    """The turn ended without an answer in Hermes's record (the model returned nothing)."""
    return RunError("the model returned an empty answer", code="upstream_empty_answer", status=502)

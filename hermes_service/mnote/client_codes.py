"""The client routes' error codes (client-proxy contract §3; docs/mnote-client.md, error table):
the contract code of each core code — the contract's stable codes first, then the documented
additions — and the HTTP status the proxy answers with."""
from __future__ import annotations

from ..errors import ServiceError

# core code -> contract code (§3 stable codes first, then our documented additions)
CODE_MAP = {
    "missing_api_key": "hermes_client_unauthorized",
    "invalid_api_key": "hermes_client_unauthorized",
    "api_key_expired": "hermes_client_unauthorized",
    "actor_mismatch": "hermes_client_unauthorized",
    "missing_actor": "hermes_client_unauthorized",
    "hermes_unavailable": "hermes_client_unconfigured",
    "hermes_unconfigured": "hermes_client_unconfigured",
    "invalid_json": "hermes_client_bad_request",
    "invalid_request": "hermes_client_bad_request",
    "invalid_id": "hermes_client_bad_request",
    "message_too_large": "hermes_client_bad_request",
    "payload_too_large": "hermes_client_bad_request",
    "bad_request_framing": "hermes_client_bad_request",     # ambiguous body framing (web/framing)
    "invalid_idempotency_key": "hermes_client_bad_request",  # docs/v1-api.md §Idempotent retries
    "upstream_unauthorized": "hermes_client_upstream_unauthorized",
    "upstream_rate_limited": "hermes_client_upstream_rate_limited",
    "upstream_unavailable": "hermes_client_upstream_unavailable",
}
EXTRA_CODES = {   # cases the contract does not cover
    "ip_not_allowed": "hermes_client_forbidden",              # 403
    "insufficient_scope": "hermes_client_forbidden",          # 403 key without the client scope
    "session_not_found": "hermes_client_not_found",           # 404 (also another actor's)
    "run_not_found": "hermes_client_not_found",               # 404
    "not_found": "hermes_client_not_found",                   # 404 unknown route
    "method_not_allowed": "hermes_client_bad_request",        # 405
    "session_busy": "hermes_client_session_busy",             # 409 a run is active
    "approval_not_pending": "hermes_client_approval_not_pending",  # 409 no such question pending
    "clarify_not_pending": "hermes_client_clarify_not_pending",    # 409 no such question pending
    "session_exists": "hermes_client_session_busy",           # 409
    "too_many_runs": "hermes_client_busy",                    # 429 all run slots taken
    "too_many_streams": "hermes_client_busy",                 # 429 mnote.max_event_streams open
    "run_timeout": "hermes_client_run_timeout",               # run.failed: hard limit
    "run_stalled": "hermes_client_run_stalled",               # run.failed: stall watchdog
    "hermes_failed": "hermes_client_upstream_unavailable",    # CLI failed otherwise
    "upstream_empty_answer": "hermes_client_upstream_empty_answer",  # run.failed: no answer
    "service_stopping": "hermes_client_service_stopping",     # run.failed: service shut down
    "run_interrupted": "hermes_client_run_interrupted",       # run.failed: its process died
    "service_draining": "hermes_client_service_draining",     # 503 stopping: no new runs
    "run_limit_exceeded": "hermes_client_run_limit_exceeded",  # run.failed: a sandbox limit
    "home_quota_exceeded": "hermes_client_home_quota_exceeded",  # run.failed: home over its cap
    "storage_full": "hermes_client_storage_full",             # 507 / run.failed: disk full
    "token_budget_exceeded": "hermes_client_token_budget_exceeded",  # 429 / run.failed
    "home_tampered": "hermes_client_home_tampered",           # 409 / run.failed: planted entry
    "home_busy": "hermes_client_busy",                        # 503 the user's state.db locked
    "legacy_endpoint_gone": "hermes_client_legacy_endpoint_gone",  # 410 /api/ai-agent/run
    # the suggestion routes (docs/mnote-client.md §Suggestions)
    "suggestion_not_found": "hermes_client_not_found",       # 404 (also another page's)
    "page_forbidden": "hermes_client_forbidden",             # 403 may not read / write the page
    "suggestion_closed": "hermes_client_suggestion_closed",  # 409 accepted or rejected already
    "page_conflict": "hermes_client_page_conflict",          # 409 a block changed since
    "kernel_unavailable": "hermes_client_kernel_unavailable",  # 503 the page store gave no answer
    # 409 Idempotency-Key reused for another request / its first request still in progress
    "idempotency_key_conflict": "hermes_client_idempotency_conflict",
    "idempotency_key_in_progress": "hermes_client_idempotency_in_progress",
    # 503 the Idempotency-Key record store is locked or damaged: nothing ran, retry later
    "idempotency_unavailable": "hermes_client_idempotency_unavailable",
    # several nodes on PostgreSQL (docs/scaling.md §Shared storage): the database unreachable,
    # the actor served by another node, a home snapshot not saved or not restorable
    "storage_unavailable": "hermes_client_storage_unavailable",
    "lease_lost": "hermes_client_actor_moved",
    "lease_busy": "hermes_client_actor_moved",
    "home_snapshot_too_slow": "hermes_client_storage_unavailable",
    "home_snapshot_damaged": "hermes_client_storage_unavailable",
}


def client_code(code: str | None) -> str:
    """The contract code for a core error code (``hermes_client_internal_error`` if unmapped)."""
    return CODE_MAP.get(code or "") or EXTRA_CODES.get(code or "") or "hermes_client_internal_error"


def public_event(event: dict) -> dict:
    """An event of the run log as the contract shows it: ``run.failed`` carries the contract
    code of the core code the run recorded."""
    if event.get("event") == "run.failed":
        return {**event, "code": client_code(event.get("code"))}
    return event


def status_for(err: ServiceError) -> int:
    """The proxy answers a provider 429 with 429, and an actor the key is not bound to as the
    contract's 401 ``hermes_client_unauthorized`` (core: 403 ``actor_mismatch``)."""
    return {"upstream_rate_limited": 429, "actor_mismatch": 401}.get(err.code, err.status)

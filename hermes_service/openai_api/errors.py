"""The error shape of the OpenAI-compatible routes (docs/openai-api.md §Errors).

Every error is ``{"error": {"message", "type", "code", "param"}}`` as OpenAI's API answers it:
``code`` is the service's stable code (:mod:`hermes_service.errors`; the v1 codes,
``insufficient_scope``, ``too_many_runs`` …), ``type`` OpenAI's class of the status (what the
SDKs and clients branch on), ``param`` the request field at fault or null. The SDKs raise
by status: 400 ``BadRequestError``, 401 ``AuthenticationError``, 403
``PermissionDeniedError``, 404 ``NotFoundError``, 409 ``ConflictError``, 413/422
``UnprocessableEntityError``/``APIStatusError``, 429 ``RateLimitError`` (with
``Retry-After``), 5xx ``InternalServerError``.
"""
from __future__ import annotations

from ..errors import ServiceError
from ..web.routing import ErrorFamily

#: OpenAI's error ``type`` of each status (others: ``api_error``)
TYPES = {400: "invalid_request_error", 401: "authentication_error",
         403: "permission_error", 404: "not_found_error", 409: "conflict_error",
         413: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}

#: the error body (components/schemas/OpenAIError in /openapi.json)
ERROR_BODY = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code", "param"],
        "properties": {"message": {"type": "string"},
                       "type": {"type": "string", "examples": ["invalid_request_error"]},
                       "code": {"type": ["string", "null"]},
                       "param": {"type": ["string", "null"]}}}}}


def render(err: ServiceError) -> dict:
    """``err`` in OpenAI's shape; ``err.extra["param"]`` names the field at fault."""
    param = err.extra.get("param")
    return {"error": {"message": err.detail, "type": TYPES.get(err.status, "api_error"),
                      "code": err.code, "param": param if isinstance(param, str) else None}}


ERRORS = ErrorFamily("OpenAIError", ERROR_BODY,
                     description="OpenAI-compatible error (docs/openai-api.md §Errors)",
                     code_path=("error", "code"), render=render)

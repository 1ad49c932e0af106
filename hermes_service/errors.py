"""Error classes with stable codes, and id validation shared by every route.

Every failure the service reports is a :class:`ServiceError` carrying an
HTTP status and a stable ``code``; the blueprints render it in their own
contract's shape (v1: ``{"detail", "code", "requestId"}``; an extension's blueprints register
theirs, e.g. the client proxy's ``{"ok": false, "code", "message", "traceId", "requestId"}``).
"""
from __future__ import annotations

import re


class ServiceError(Exception):
    """A failure with an HTTP ``status``, a stable ``code`` and a human ``detail``.

    ``headers`` are added to the response (e.g. ``Retry-After``); ``extra``
    is merged into the JSON body.
    """
    status = 500
    code = "internal_error"
    #: the Hermes session a failed turn left behind (set by the runners), or None
    hermes_session_id: str | None = None

    def __init__(self, detail: str, *, code: str | None = None, status: int | None = None,
                 headers: dict | None = None, extra: dict | None = None):
        super().__init__(detail)
        self.detail = detail
        if code:
            self.code = code
        if status:
            self.status = status
        self.headers = headers or {}
        self.extra = extra or {}


class BadRequest(ServiceError):
    status, code = 400, "invalid_request"


class Unauthorized(ServiceError):
    status, code = 401, "invalid_api_key"


class Forbidden(ServiceError):
    status, code = 403, "forbidden"


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Conflict(ServiceError):
    status, code = 409, "conflict"


class TooLarge(ServiceError):
    status, code = 413, "payload_too_large"


class StorageFull(ServiceError):
    """A file system the service writes to is full, or below its free-space floor
    (``hermes.sandbox.min_free_mb``): 507 Insufficient Storage (RFC 4918 §11.5), never a
    500; nothing was half-written (docs/sandbox.md §Disk)."""
    status, code = 507, "storage_full"


#: SQLite's errors of a write the disk (or a quota) refused: ``SQLITE_FULL``, and the I/O
#: errors of growing a file (a WAL's shared memory on a full tmpfs is ``IOERR_SHMSIZE``)
SQLITE_FULL_ERRORS = frozenset({"SQLITE_FULL", "SQLITE_IOERR_SHMSIZE", "SQLITE_IOERR_WRITE",
                                "SQLITE_IOERR_FSYNC", "SQLITE_IOERR_TRUNCATE",
                                "SQLITE_IOERR_SHMMAP"})


def storage_full(exc: BaseException | None) -> bool:
    """Is ``exc`` (or what caused it) a write refused for want of space: ``ENOSPC``,
    ``EDQUOT`` (a quota), SQLite's :data:`SQLITE_FULL_ERRORS`?"""
    import errno
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if getattr(exc, "sqlite_errorname", None) in SQLITE_FULL_ERRORS:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class TooManyRuns(ServiceError):
    """All CLI slots busy for longer than ``hermes.queue_wait_seconds``."""
    status, code = 429, "too_many_runs"


class Unconfigured(ServiceError):
    """The Hermes command or the model provider is not configured/usable."""
    status, code = 503, "hermes_unconfigured"


class RunError(ServiceError):
    """A Hermes CLI run failed; ``code`` classifies why (see runner.classify_failure)."""
    status, code = 502, "hermes_failed"


# Ids end up in file names (user homes, lock files) and in the page store: one
# strict rule for all of them; no '/', NUL, whitespace, and never '..'.
# The pattern is also used in JSON schemas (jsonschema applies it with re.search; a model
# provider may read it as an ECMA-262 regex): "(?!\n)$" anchors at the true end in both
# dialects, where Python's bare "$" would also match before a final newline ("ws\n").
ID_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}(?!\n)$"
_ID = re.compile(ID_PATTERN)
ID_RULE = "1-128 characters of A-Z a-z 0-9 _ . @ : - starting with a letter or digit, without '..'"
#: the id rule as JSON Schema, for request schemas and the OpenAPI document (a request body
#: field failing it is answered 400 ``invalid_id``, like :func:`check_id`)
ID_SCHEMA = {"type": "string", "pattern": ID_PATTERN, "description": f"an id: {ID_RULE}"}
#: a JSON Schema pattern for text without NUL (messages: NUL cannot travel in a CLI argument)
NO_NUL = "^[^\\u0000]*$"


def is_id(value) -> bool:
    """True if ``value`` is a safe id: the one rule every id on every path goes through
    (HTTP routes, page store, tool schemas, operator commands). A full match of
    :data:`ID_PATTERN`: 1–128 chars of ``A-Z a-z 0-9 _ . @ : -``, starting with a letter or
    digit, no ``..``, nothing before or after (no trailing newline)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def check_id(value, field: str) -> str:
    """Return ``value`` if it is a safe id (:func:`is_id`), else raise :class:`BadRequest`
    (code ``invalid_id``). Used for ``user_id``, session ids, run ids, workspace/document
    ids and trace ids alike."""
    if not is_id(value):
        raise BadRequest(f"{field} must be {ID_RULE}", code="invalid_id")
    return value


def schema_error(err, limit: int = 300) -> tuple[list[str], str]:
    """A jsonschema ``ValidationError`` as ``(path, reason)``: the one reading of a schema
    error every caller formats (request bodies ``a/b: …``, tool envelopes and pages as JSON
    pointers, config as ``a.b: …``). ``required`` and ``additionalProperties`` errors name the
    offending field in the path, a ``oneOf``/``anyOf`` of ``required`` alone names its fields
    (never the instance); the reason is cut at ``limit`` characters."""
    path, reason = [str(p) for p in err.absolute_path], err.message
    if err.validator == "required" and isinstance(err.instance, dict):
        missing = [p for p in err.validator_value if p not in err.instance]
        if missing:
            path.append(str(missing[0]))
            reason = "is required"
    elif err.validator in ("oneOf", "anyOf") and isinstance(err.instance, dict) and all(
            set(branch) == {"required"} for branch in err.validator_value):
        # "exactly one of a, b": the default message would repeat the whole instance
        names = ", ".join(n for branch in err.validator_value for n in branch["required"])
        reason = (f"needs exactly one of {names}" if err.validator == "oneOf"
                  else f"needs one of {names}")
    elif err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = err.schema.get("properties", {})
        extra = sorted(k for k in err.instance if k not in allowed)
        if extra:
            path.append(str(extra[0]))
            reason = "is not an allowed field"
    if len(reason) > limit:
        reason = reason[:limit] + "…"
    return path, reason


def json_pointer(path: list) -> str:
    """``["args", "content", 0]`` → ``/args/content/0`` (RFC 6901 escaping); ``[]`` → ``/``."""
    if not path:
        return "/"
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)

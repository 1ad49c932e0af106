"""What the model pass-through forwards to the provider: one allowlist (docs/sandbox.md
§What the pass-through forwards).

The pass-through's credential is readable inside its process's sandbox, so every request it
receives is treated as the user's agent's own. It forwards only what Hermes 0.19.0 sends for a
turn with ``provider: custom`` (the provider every home gets, homes/users.py), measured by
recording real turns and read in Hermes's code (``agent/transports/chat_completions.py``,
``plugins/model-providers/custom``, ``agent/auxiliary_client.py``, ``agent/model_metadata.py``):

* ``POST /v1/chat/completions`` — the turn itself (streamed) and Hermes's side calls (titles,
  summaries: JSON);
* ``GET /v1/models`` — model metadata.

Everything else is answered here and never forwarded. Because the pass-through is on
loopback Hermes takes it for a local server and probes it (``is_local_endpoint``,
``detect_local_server_type``: ``GET /v1/props``, ``/props``, ``/api/tags``,
``/api/v1/models``, ``/version``); a real provider answers those 404, and so does the
pass-through, without counting them anywhere.

:func:`route` — the method and the exact target (no query, no other spelling) →
:data:`ROUTES`; :class:`Policy` — a chat request's body: JSON (UTF-8), an object whose
fields are in :data:`CHAT_FIELDS`, each object inside of the shape Hermes sends
(:mod:`hermes_service.model_proxy.request`), ``model`` one the config offers, at most
:func:`max_request_bytes`; streamed requests get ``stream_options.include_usage: true``
(every token counted) and the body is sent re-encoded from what was checked (a key given
twice, another encoding: the provider sees exactly what was checked); :func:`forward_headers`
— the request headers the provider needs (:data:`FORWARD_HEADERS`), nothing else;
:class:`UsageStripper` — the usage chunk taken out of a stream whose caller did not ask for
it. A refused request raises :class:`Refusal` (an OpenAI-shaped error: status, ``type``,
``code``, message).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .request import CHAT_REQUEST_FIELDS, Invalid, check

#: target → the one method it is forwarded for
ROUTES = {"/v1/chat/completions": "POST", "/v1/models": "GET"}
#: the top-level fields of a chat completions request that are forwarded (each object inside
#: them checked too: :mod:`hermes_service.model_proxy.request`): those Hermes 0.19.0 sends to a
#: ``custom`` provider (model, messages, tools, stream, stream_options, max_tokens,
#: temperature, reasoning_effort, think) and the OpenAI sampling fields that change neither
#: the account nor what is billed per token. Refused: ``n`` (several answers billed),
#: ``service_tier``, ``store``/``metadata``, ``audio``/``modalities``,
#: ``web_search_options``, ``prediction``, ``user`` and anything else.
CHAT_FIELDS = frozenset(CHAT_REQUEST_FIELDS)
#: request headers forwarded (lower case); ``Authorization`` is the service's own, added by
#: the pass-through; ``Content-Length`` is recomputed; ``Accept-Encoding`` is ``identity``
#: (the pass-through reads every answer). Everything else — ``x-api-key``, ``api-key``,
#: ``OpenAI-Organization``/``-Project``, ``X-Forwarded-*``, ``Forwarded``, ``Cookie``, … —
#: is dropped.
FORWARD_HEADERS = frozenset({
    "accept", "content-type", "user-agent", "x-stainless-arch", "x-stainless-async",
    "x-stainless-lang", "x-stainless-os", "x-stainless-package-version",
    "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-retry-count",
    "x-stainless-read-timeout", "x-stainless-timeout"})
#: bytes a request may carry per token of ``hermes.model.context_length``: the largest
#: request Hermes made before compacting a 128 000-token context of CJK tool output was
#: 1.06 MB (8.3 bytes per token; docs/sandbox.md), so the cap leaves room four times over
BYTES_PER_TOKEN = 32
MIN_REQUEST_BYTES = 4 * 1024 * 1024
#: a body larger than this is refused whatever the context length
MAX_REQUEST_BYTES = 64 * 1024 * 1024


def max_request_bytes(context_length: int | None) -> int:
    """The body cap for a model of ``context_length`` tokens: ``32 × context_length`` bytes,
    at least 4 MiB, at most 64 MiB (4 MiB for the shipped 128 000)."""
    n = BYTES_PER_TOKEN * int(context_length or 0)
    return min(MAX_REQUEST_BYTES, max(MIN_REQUEST_BYTES, n))


class Refusal(Exception):
    """A request the pass-through answers itself: ``status``, OpenAI error ``etype`` and
    ``code``, ``message``; ``headers`` to add; ``counted`` — whether it counts as a
    ``refused`` request (an unknown route does not: Hermes probes them itself)."""

    def __init__(self, status: int, code: str, message: str,
                 etype: str = "invalid_request_error", headers: dict | None = None,
                 counted: bool = True):
        super().__init__(message)
        self.status, self.code, self.message, self.etype = status, code, message, etype
        self.headers = headers or {}
        self.counted = counted


def route(method: str, target: str) -> str:
    """The path of an allowed request (``target`` exactly as sent). Raises :class:`Refusal`:
    404 ``not_found`` (uncounted) for any other target — a query, a trailing slash, an
    encoded or doubled character included —, 405 ``method_not_allowed`` for another
    method."""
    want = ROUTES.get(target)
    if want is None:
        raise Refusal(404, "not_found", f"no such route: {method} {target[:200]} (the "
                      "pass-through serves POST /v1/chat/completions and GET /v1/models)",
                      counted=False)
    if method != want:
        raise Refusal(405, "method_not_allowed", f"{target} takes {want} only",
                      headers={"Allow": want})
    return target


def forward_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The caller's headers the provider gets: those of :data:`FORWARD_HEADERS`, the first of
    each name only, each value on one line (a folded value's line breaks become spaces) and
    at most 1 000 characters."""
    out, seen = [], set()
    for k, v in headers:
        low = k.lower()
        if low in FORWARD_HEADERS and low not in seen:
            seen.add(low)
            out.append((k, " ".join(str(v).split())[:1000]))
    return out


@dataclass(frozen=True)
class Prepared:
    """A checked chat request: ``body`` to send, ``stream`` (streamed answer), ``usage_asked``
    (the caller asked for the usage chunk itself), ``prompt_estimate`` (tokens, a quarter of
    the body's bytes: what is counted if the provider's usage never comes), ``max_output``
    (the output tokens it asks for at most: ``max_completion_tokens``, ``max_tokens``, else
    None)."""
    body: bytes
    stream: bool
    usage_asked: bool
    prompt_estimate: int
    max_output: int | None = None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


#: digits an integer of a chat body may have: an int's parse is quadratic in its digits (a
#: 4 299-digit one holds the GIL ~0.4 ms), and no field Hermes sends needs more than a seed's 20
MAX_INT_DIGITS = 40


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):      # 1e999: would be sent as Infinity
        raise ValueError(f"{text[:20]} is too large a number")
    return value


def _encode(obj) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:          # a lone surrogate ("\ud800"): kept escaped
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


@dataclass(frozen=True)
class Policy:
    """The rules of one configuration: ``models`` the config offers (:func:`offered_models`),
    ``max_body`` the body cap in bytes."""
    models: frozenset
    max_body: int

    def prepare_chat(self, body: bytes, content_type: str | None) -> Prepared:
        """Check a ``POST /v1/chat/completions`` body and make what is sent (module doc).
        Raises :class:`Refusal` (400 ``invalid_request_body`` / ``unsupported_parameter``,
        404 ``model_not_found``, 415 ``unsupported_media_type``)."""
        ctype = (content_type or "").split(";", 1)
        params = ctype[1].strip().lower().replace(" ", "") if len(ctype) > 1 else ""
        if ctype[0].strip().lower() != "application/json" or params not in ("", "charset=utf-8"):
            raise Refusal(415, "unsupported_media_type",
                          "the body must be application/json (UTF-8)")
        try:
            obj = json.loads(body.decode("utf-8"), parse_constant=_no_constant,
                             parse_float=_finite, parse_int=_short_int)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise Refusal(400, "invalid_request_body",
                          f"the body is not UTF-8 JSON ({type(exc).__name__})") from None
        if not isinstance(obj, dict):
            raise Refusal(400, "invalid_request_body", "the body must be a JSON object")
        extra = sorted(k for k in obj if k not in CHAT_FIELDS)
        if extra:
            raise Refusal(400, "unsupported_parameter",
                          f"{extra[0][:100]!r} is not forwarded by this endpoint (it forwards "
                          f"{', '.join(sorted(CHAT_FIELDS))})")
        model = obj.get("model")
        if not isinstance(model, str) or model not in self.models:
            shown = model[:100] if isinstance(model, str) else type(model).__name__
            raise Refusal(404, "model_not_found", f"the model {shown!r} is not offered here "
                          f"(offered: {', '.join(sorted(self.models)) or 'none'})")
        if not isinstance(obj.get("messages"), list):
            raise Refusal(400, "invalid_request_body", "'messages' must be an array")
        try:
            check(obj)
        except Invalid as bad:
            raise Refusal(400, bad.code, bad.message) from None
        stream = obj.get("stream", False)
        asked = False
        if stream:
            opts = dict(obj.get("stream_options") or {})
            asked = opts.get("include_usage") is True
            opts["include_usage"] = True
            obj["stream_options"] = opts
        out = _encode(obj)
        return Prepared(out, stream, asked, len(out) // 4,
                        obj.get("max_completion_tokens") or obj.get("max_tokens"))


def offered_models(home_config: dict, extra: Iterable[str] = ()) -> frozenset:
    """The model names a Hermes home may ask for: ``model.default`` of its config, every
    ``auxiliary.<task>.model`` and ``delegation.model`` it names (a non-empty string), and
    ``extra`` (the extensions' own, e.g. the models their runs pass with ``-m``)."""
    names = set()

    def take(value) -> None:
        if isinstance(value, str) and value.strip():
            names.add(value.strip())
    model = home_config.get("model")
    if isinstance(model, dict):
        take(model.get("default"))
    aux = home_config.get("auxiliary")
    if isinstance(aux, dict):
        for task in aux.values():
            if isinstance(task, dict):
                take(task.get("model"))
    delegation = home_config.get("delegation")
    if isinstance(delegation, dict):
        take(delegation.get("model"))
    for name in extra:
        take(name)
    return frozenset(names)


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class UsageStripper:
    """Takes the usage chunk (``data: {…, "choices": [], "usage": {…}}``, what
    ``stream_options.include_usage`` adds at the end of an OpenAI stream) out of an event
    stream whose caller did not ask for it; every other event passes byte for byte. Feed each
    piece as read (:meth:`feed` returns what to relay now: whole events only), then
    :meth:`flush` at the end."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out, start = [], 0
        for m in _EVENT_END.finditer(self._buf):
            event = self._buf[start:m.end()]
            start = m.end()
            if not _usage_only(event):
                out.append(event)
        self._buf = self._buf[start:]
        if len(self._buf) > 1024 * 1024:          # one endless event: pass it on as it is
            out.append(self._buf)
            self._buf = b""
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return b"" if _usage_only(rest) else rest


def _usage_only(event: bytes) -> bool:
    if b'"usage"' not in event:
        return False
    data = [ln[5:].strip() for ln in re.split(rb"\r\n|\n|\r", event) if ln.startswith(b"data:")]
    if len(data) != 1:
        return False
    try:
        obj = json.loads(data[0])
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("choices") == [] \
        and isinstance(obj.get("usage"), dict)

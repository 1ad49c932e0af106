"""The model pass-through (docs/sandbox.md §Model pass-through): its lifetime on a loopback
port, live reload, the per-process credentials, what one user and all users may hold at
once, and the daily token budget."""
from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..embedded_http import OpenConnections, stop_server
from . import limits
from .body_check import BodyChecker
from .handler import Handler, Server, Server6
from .policy import Policy, Prepared, Refusal, max_request_bytes
from .upstream import Connections, Upstream, upstream
from .usage import UsageStore, budget_message, seconds_to_midnight

if TYPE_CHECKING:       # storage.url only (psycopg)
    from ..storage.usage import PgUsageStore

log = logging.getLogger("hermes_service.model_proxy")


def _digest(credential: str) -> bytes:
    return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).digest()


def user_body_budget(policy: Policy) -> int:
    """Request body bytes one user may hold at once: :data:`~.limits.USER_BODY_BUDGET`, at
    least the body cap (a lone body of the cap is always admitted)."""
    return max(limits.USER_BODY_BUDGET, policy.max_body)


class ModelProxy:
    """The pass-through model endpoint (docs/sandbox.md §Model pass-through).

    ``upstream_base_url``: the provider's API root (``https://api.example.com/v1``), None while
    no provider is configured (every request then gets 502). ``api_key_env``: the environment
    variable holding the provider key (read at each request), None for no key.
    ``usage_db``: the SQLite file of per-user usage (:class:`UsageStore`, normally
    :func:`~hermes_service.model_proxy.usage.usage_db_path` of the data dir). ``read_timeout``:
    seconds to wait for the provider's answer headers and for each later read (> 0).
    ``host``: the loopback address to bind. ``upstream_proxy``: ``http://[user:password@]
    host[:port]`` to reach the provider through (normally
    :func:`~.upstream.upstream_proxy_for` of ``hermes.extra_env``), None for direct; an
    unusable one is logged and makes every request a 502, never a direct one. Raises
    ValueError for an unusable upstream URL or timeout.
    """

    def __init__(self, upstream_base_url: str | None, api_key_env: str | None, usage_db: Path,
                 read_timeout: float = 300.0, host: str = "127.0.0.1",
                 upstream_proxy: str | None = None, models=(), context_length: int = 128000,
                 daily_tokens: int | None = None):
        self._settings = upstream(upstream_base_url, api_key_env, read_timeout, upstream_proxy)
        self.policy = Policy(frozenset(models), max_request_bytes(context_length))
        self.daily_tokens = daily_tokens
        self.host = host
        #: per-user usage: the data dir's SQLite; the shared PostgreSQL's with storage.url
        #: (:class:`~hermes_service.storage.usage.PgUsageStore`, set by the services)
        self.usage: UsageStore | PgUsageStore = UsageStore(Path(usage_db))
        self.connections = Connections()
        self._creds: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self._conns = OpenConnections()          # caller connections open now
        self._inflight: dict[str, int] = {}        # user -> requests in flight
        self._body_bytes = 0                       # request body bytes held now
        self._user_bytes: dict[str, int] = {}      # ... per user
        self._reserved: dict[str, int] = {}        # user -> tokens its requests hold now
        self.bodies = BodyChecker()
        self._server: Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifetime ---------------------------------------------------------------------
    def start(self) -> ModelProxy:
        """Bind an ephemeral port on ``host`` and serve in daemon threads. Idempotent."""
        if self._server is not None:
            return self
        cls = Server6 if ":" in self.host else Server
        srv = cls((self.host, 0), Handler)
        srv.endpoint = self
        self._server = srv
        self._thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"model-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: open exchanges are cut, idle upstream connections closed, queued
        usage written."""
        srv, self._server = self._server, None
        if srv is not None:
            stop_server(srv, self._thread, self._conns)
            self._thread = None
        self.connections.clear()
        self.bodies.close()
        self.usage.close()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the model proxy is not started")
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        """What a Hermes home names as ``model.base_url``: ``http://127.0.0.1:PORT/v1``.
        RuntimeError before :meth:`start`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def settings(self) -> Upstream | None:
        """The provider requests go to now (None: none is configured)."""
        return self._settings

    def configure(self, upstream_base_url: str | None, api_key_env: str | None,
                  read_timeout: float = 300.0, upstream_proxy: str | None = None,
                  models=None, context_length: int | None = None,
                  daily_tokens: int | None = None) -> None:
        """Live reload: requests that start from now on use these settings (ones in flight
        finish with the old). ``models``/``context_length`` None keep the current policy's.
        Raises ValueError like the constructor (the old settings stay)."""
        new = upstream(upstream_base_url, api_key_env, read_timeout, upstream_proxy)
        old, self._settings = self._settings, new
        self.policy = Policy(
            self.policy.models if models is None else frozenset(models),
            self.policy.max_body if context_length is None else max_request_bytes(context_length))
        self.daily_tokens = daily_tokens
        if new != old:
            self.connections.clear()

    # -- what a user may spend -----------------------------------------------------------
    def check_budget(self, user_id: str) -> None:
        """Raise :class:`~hermes_service.model_proxy.policy.Refusal` 429 ``token_budget_exceeded``
        when ``user_id`` has used ``daily_tokens`` tokens today (UTC; every service process
        on the data dir counted), those its requests in flight hold (:meth:`reserve`)
        included. Nothing without a budget; a usage db that cannot be read
        does not stop a request (logged)."""
        budget = self.daily_tokens
        if not budget:
            return
        try:
            spent = self.usage.spent(user_id)
        except sqlite3.Error as exc:
            log.warning("model usage of user=%s not readable: %s", user_id, exc)
            return
        with self._lock:
            held = self._reserved.get(user_id, 0)
        if spent + held >= budget:
            raise Refusal(429, "token_budget_exceeded", budget_message(spent + held, budget),
                          etype="insufficient_quota",
                          headers={"Retry-After": str(seconds_to_midnight())})

    @contextmanager
    def reserve(self, user_id: str, prepared: Prepared) -> Iterator[None]:
        """Hold the tokens ``prepared`` may cost (its prompt estimate and the output it asks
        for, :data:`~.limits.RESERVE_OUTPUT_TOKENS` when it names none) against ``user_id``'s
        ``daily_tokens`` while it runs — checked with :meth:`check_budget` (what is spent and
        what the user's other requests hold), so requests in parallel cannot together go past
        the budget: at most the one admitted last goes past it, by at most its own size.
        Given back when the request ends (its usage is counted by then). Raises
        :class:`~hermes_service.model_proxy.policy.Refusal` 429 ``token_budget_exceeded``."""
        if not self.daily_tokens:
            yield
            return
        need = prepared.prompt_estimate + (prepared.max_output or limits.RESERVE_OUTPUT_TOKENS)
        self.check_budget(user_id)
        with self._lock:
            self._reserved[user_id] = self._reserved.get(user_id, 0) + need
        try:
            yield
        finally:
            with self._lock:
                left = self._reserved.get(user_id, need) - need
                if left > 0:
                    self._reserved[user_id] = left
                else:
                    self._reserved.pop(user_id, None)

    @contextmanager
    def admit(self, user_id: str, length: int) -> Iterator[Refusal | None]:
        """Hold one of ``user_id``'s :data:`~.limits.MAX_USER_REQUESTS` places and ``length``
        bytes of :data:`~.limits.BODY_BUDGET` (and of :func:`user_body_budget`)
        while a request is read and answered; yields None, or the
        :class:`~hermes_service.model_proxy.policy.Refusal` (429 / 503) when either is taken."""
        with self._lock:
            if self._inflight.get(user_id, 0) >= limits.MAX_USER_REQUESTS or \
                    self._user_bytes.get(user_id, 0) + length > user_body_budget(self.policy):
                refusal: Refusal | None = Refusal(
                    429, "too_many_requests", f"more than {limits.MAX_USER_REQUESTS} model "
                    "requests (or their bodies over "
                    f"{user_body_budget(self.policy) // (1024 * 1024)} MiB) of this user at once",
                    etype="rate_limit_error", headers={"Retry-After": "1"})
            elif self._body_bytes + length > limits.BODY_BUDGET:
                refusal = Refusal(503, "server_overloaded", "the pass-through holds too many "
                                  "request bodies now; retry", etype="server_error",
                                  headers={"Retry-After": "1"})
            else:
                refusal = None
                self._inflight[user_id] = self._inflight.get(user_id, 0) + 1
                self._user_bytes[user_id] = self._user_bytes.get(user_id, 0) + length
                self._body_bytes += length
        if refusal is not None:
            yield refusal
            return
        try:
            yield None
        finally:
            with self._lock:
                left = self._inflight.get(user_id, 1) - 1
                if left:
                    self._inflight[user_id] = left
                else:
                    self._inflight.pop(user_id, None)
                held = self._user_bytes.get(user_id, length) - length
                if held > 0:
                    self._user_bytes[user_id] = held
                else:
                    self._user_bytes.pop(user_id, None)
                self._body_bytes -= length

    def prepare(self, user_id: str, body: bytes, content_type: str | None) -> Prepared:
        """The checked request ``body`` of ``user_id`` (:class:`~.body_check.BodyChecker`:
        inline or in a worker process, within the user's share). Raises
        :class:`~hermes_service.model_proxy.policy.Refusal`."""
        return self.bodies.prepare(self.policy, user_id, body, content_type)

    # -- credentials --------------------------------------------------------------------
    def issue(self, user_id: str) -> str:
        """A fresh random credential (``secrets.token_urlsafe(32)``, 256 bits) for one Hermes
        process of ``user_id``; valid until :meth:`revoke`. Only its SHA-256 is kept."""
        if not isinstance(user_id, str) or not user_id:
            raise ValueError("user_id must be a non-empty string")
        credential = "hsm-" + secrets.token_urlsafe(32)
        with self._lock:
            self._creds[_digest(credential)] = user_id
        return credential

    def revoke(self, credential: str) -> None:
        """Make ``credential`` invalid at once (unknown ones are ignored)."""
        with self._lock:
            self._creds.pop(_digest(credential), None)

    def user_for(self, authorization: str | None) -> str | None:
        """The user of an ``Authorization: Bearer <credential>`` header (RFC 6750 §2.1), or
        None for any other header or a credential not issued or revoked. The lookup is by
        digest: the raw credential is compared nowhere."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        with self._lock:
            return self._creds.get(_digest(token.strip()))

    # -- answers and connections ---------------------------------------------------------
    def local_location(self, value: str) -> str:
        """A redirect into the upstream base points back at this endpoint (so the caller
        never goes to the provider itself); any other Location stays as sent."""
        s = self._settings
        if s is None or self._server is None:
            return value
        for prefix in (f"{s.scheme}://{s.netloc}{s.base_path}", s.base_path):
            if prefix and value.startswith(prefix) and (
                    len(value) == len(prefix) or value[len(prefix)] in "/?"):
                return (self.base_url if prefix[0] != "/" else "/v1") + value[len(prefix):]
        return value

    def open_connections(self) -> int:
        """Caller connections open now."""
        return len(self._conns)

    def track(self, conn: socket.socket, add: bool) -> None:
        """A caller connection opened (``add``) or closed."""
        self._conns.track(conn, add)

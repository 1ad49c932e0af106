"""The provider behind the model pass-through (docs/sandbox.md §Forwarding, §Upstream HTTP
proxy): its settings — the API root, the key's variable, the read timeout, the HTTP proxy to
go through — and the connections to it, kept alive and reused."""
from __future__ import annotations

import base64
import http.client
import logging
import ssl
import threading
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import unquote, urlsplit
from urllib.request import proxy_bypass_environment  # type: ignore[attr-defined]

from . import limits

log = logging.getLogger("hermes_service.model_proxy")


def upstream_proxy_for(env: Mapping[str, str] | None,
                       upstream_base_url: str | None) -> str | None:
    """The HTTP proxy to reach ``upstream_base_url`` through, picked from the environment-style
    mapping ``env`` (``hermes.extra_env``; never ``os.environ``) as curl, requests and httpx
    pick it: ``https_proxy``/``HTTPS_PROXY`` for an ``https`` upstream, ``http_proxy``/
    ``HTTP_PROXY`` for ``http``, else ``all_proxy``/``ALL_PROXY``; the lower-case name first,
    an empty value counts as unset. ``no_proxy``/``NO_PROXY`` (comma-separated host names,
    domain suffixes with or without a leading dot, optional ``:port``; ``*`` for every host)
    is matched by :func:`urllib.request.proxy_bypass_environment` against the upstream's host.

    Returns the variable's value (stripped) as given, credentials included, or None: no
    proxy applies, or ``upstream_base_url`` is None or not an http(s) URL. Never raises; the
    value is checked by :class:`~.proxy.ModelProxy`. Docs:
    https://curl.se/docs/manpage.html#ENVIRONMENT,
    https://www.python-httpx.org/environment_variables/,
    https://docs.python.org/3/library/urllib.request.html#urllib.request.getproxies
    """
    if not env or not upstream_base_url:
        return None
    try:
        parts = urlsplit(upstream_base_url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not host:
        return None

    def pick(name: str) -> str | None:
        for key in (name, name.upper()):
            value = env.get(key)
            if isinstance(value, str) and value.strip():
                return value.strip()
        return None

    proxy = pick(f"{scheme}_proxy") or pick("all_proxy")
    if proxy is None:
        return None
    no_proxy = pick("no_proxy")
    if no_proxy:
        port = port or (443 if scheme == "https" else 80)
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bypass = {"no": no_proxy}
        if proxy_bypass_environment(host, bypass) or proxy_bypass_environment(netloc, bypass):
            return None
    return proxy


class HttpProxy(NamedTuple):
    host: str
    port: int
    auth: str | None         # the Proxy-Authorization value ("Basic …"), None without one
    shown: str               # "http://host:port": for logs (no credentials)


class Upstream(NamedTuple):
    """Where requests go: the provider's API root, its key's variable, the read timeout,
    and the HTTP proxy to go through (or why the configured one cannot be used)."""
    scheme: str              # "http" | "https"
    host: str
    port: int
    base_path: str           # without trailing slash, e.g. "/v1"
    api_key_env: str | None
    read_timeout: float
    proxy: HttpProxy | None = None
    proxy_error: str | None = None   # an unusable upstream_proxy: every request gets 502

    @property
    def netloc(self) -> str:
        """``host[:port]`` as in a URL (port left out when it is the scheme's default)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def pool_key(self) -> tuple:
        return (self.scheme, self.host, self.port, self.proxy)

    @property
    def where(self) -> str:
        """The upstream for logs: ``host:port``, plus `` via http://proxy:port``."""
        via = f" via {self.proxy.shown}" if self.proxy is not None else ""
        return f"{self.host}:{self.port}{via}"


def _http_proxy(url: str | None) -> tuple[HttpProxy | None, str | None]:
    """``(proxy, None)``, ``(None, None)`` for no proxy, or ``(None, why)`` when ``url`` is
    unusable (``why`` never quotes the URL: it may carry credentials)."""
    if url is None or not url.strip():
        return None, None
    raw = url.strip()
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None, "not a host[:port] URL"
    if parts.scheme.lower() != "http":
        return None, f"{parts.scheme.lower()}:// proxies are not supported (http:// only)"
    if not host:
        return None, "no host in the proxy URL"
    port = port or 80
    auth = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
    shown = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return HttpProxy(host, port, auth, shown), None


def upstream(upstream_base_url: str | None, api_key_env: str | None,
             read_timeout: float, upstream_proxy: str | None = None) -> Upstream | None:
    """The :class:`Upstream` of these settings (None: no provider configured). Raises
    ValueError for an unusable URL or timeout; an unusable proxy is logged and kept as
    :attr:`Upstream.proxy_error` (every request then gets 502, never a direct one)."""
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("read_timeout must be > 0 seconds")
    if not upstream_base_url:
        return None
    parts = urlsplit(upstream_base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream_base_url must be an http(s) URL, got {upstream_base_url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError("upstream_base_url must not carry credentials, a query or a fragment")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    proxy, proxy_error = _http_proxy(upstream_proxy)
    out = Upstream(parts.scheme, parts.hostname, port, parts.path.rstrip("/"),
                   api_key_env or None, float(read_timeout), proxy,
                   f"unusable upstream proxy: {proxy_error}" if proxy_error else None)
    if out.proxy_error is not None:
        log.warning("model pass-through: %s; every model request gets 502 until it is fixed",
                    out.proxy_error)
    return out


class Connections:
    """Connections to the provider, kept alive and reused: at most :data:`~.limits.POOL_SIZE`
    idle per upstream origin and proxy (proxied and direct ones are never mixed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: dict[tuple, list[http.client.HTTPConnection]] = {}
        self._ssl: ssl.SSLContext | None = None

    def new(self, s: Upstream) -> http.client.HTTPConnection:
        """A connected socket to the provider: direct, through a ``CONNECT`` tunnel (https
        upstream, proxy set; TLS checked against the provider's name) or to the proxy itself
        (http upstream; the request then names the absolute URI)."""
        timeout = min(limits.CONNECT_TIMEOUT, s.read_timeout)
        px = s.proxy
        host, port = (px.host, px.port) if px is not None else (s.host, s.port)
        conn: http.client.HTTPConnection
        if s.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
            if px is not None:
                conn.set_tunnel(s.host, s.port, headers=(
                    {"Proxy-Authorization": px.auth} if px.auth else None))
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.connect()
        except TimeoutError:          # no connection at all: unreachable (502), not 504
            conn.close()
            raise ConnectionError(f"connect timed out after {timeout:g} s") from None
        if conn.sock is not None:
            conn.sock.settimeout(s.read_timeout)
        return conn

    def get(self, s: Upstream) -> tuple[http.client.HTTPConnection | None, bool]:
        """An idle connection to ``s`` and True, or ``(None, False)``."""
        with self._lock:
            idle = self._pool.get(s.pool_key)
            conn = idle.pop() if idle else None
        if conn is not None and conn.sock is not None:
            conn.sock.settimeout(s.read_timeout)
            return conn, True
        return None, False

    def put(self, s: Upstream, conn: http.client.HTTPConnection, current: Upstream | None) -> None:
        """Keep ``conn`` (to ``s``) for reuse, unless the settings changed since
        (``current``), it is closed, or enough are kept."""
        if conn.sock is None or current != s:
            conn.close()
            return
        with self._lock:
            idle = self._pool.setdefault(s.pool_key, [])
            if len(idle) < limits.POOL_SIZE:
                idle.append(conn)
                return
        conn.close()

    def clear(self) -> None:
        """Close every idle connection."""
        with self._lock:
            pools, self._pool = self._pool, {}
        for idle in pools.values():
            for conn in idle:
                conn.close()

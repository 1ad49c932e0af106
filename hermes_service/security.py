"""IP allowlist, trusted proxies and API keys (spec §认证机制; docs/configuring.md).

* The client address is the TCP peer. ``X-Forwarded-For`` is honoured only
  when ``nginx.enable_real_ip`` is on and the peer is a trusted proxy; then
  the client is the rightmost address in the chain that is not itself a
  trusted proxy (the leftmost entries are client-controlled and ignored).
* Keys come as ``X-API-Key`` (``auth_method: header``, header name from
  ``api_key_header``) or ``Authorization: Bearer`` (``auth_method: bearer``).
  Only SHA-256 digests are kept; every configured digest is compared with
  :func:`hmac.compare_digest` so timing reveals nothing.
* 403 ``ip_not_allowed`` for a refused address; 401 ``missing_api_key``,
  ``invalid_api_key`` or ``api_key_expired`` for key problems.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
from datetime import UTC, datetime

from .config import ApiKey, NginxSettings, SecuritySettings
from .errors import Forbidden, Unauthorized


@functools.lru_cache(maxsize=4096)     # each request parses its peer (twice): once per peer
def _addr(text: str | None):
    try:
        return ipaddress.ip_address((text or "").strip().split("%")[0])
    except ValueError:
        return None


def _in(addr, networks) -> bool:
    if addr is None:
        return False
    if getattr(addr, "ipv4_mapped", None):
        addr = addr.ipv4_mapped
    return any(addr.version == net.version and addr in net for net in networks)


class Guard:
    """Decides whether a request may pass. Built from the ``security`` and ``nginx``
    sections (a reload builds a new one)."""

    def __init__(self, security: SecuritySettings, nginx: NginxSettings):
        self.ip_check = security.enable_ip_check
        self.allowed = security.allowed_networks
        self.trusted = nginx.trusted_proxies
        self.real_ip = nginx.enable_real_ip
        self.key_check = security.enable_api_key
        self.bearer = security.bearer
        self.header = security.api_key_header
        self.keys = security.api_keys

    def client_ip(self, peer: str | None, forwarded_for: str | None) -> str | None:
        """The client address as text: the peer, or the X-Forwarded-For hop described above."""
        peer_addr = _addr(peer)
        if not (self.real_ip and forwarded_for and _in(peer_addr, self.trusted)):
            return str(peer_addr) if peer_addr else peer
        for hop in reversed([h.strip() for h in forwarded_for.split(",")]):
            hop_addr = _addr(hop)
            if hop_addr is None:
                return None   # a garbled chain is not trusted
            if not _in(hop_addr, self.trusted):
                return str(hop_addr)
        return str(peer_addr)

    def check_ip(self, client_ip: str | None) -> None:
        """Raise :class:`Forbidden` (``ip_not_allowed``) unless the address is allowed."""
        if self.ip_check and not _in(_addr(client_ip), self.allowed):
            raise Forbidden(f"client address {client_ip} is not allowed", code="ip_not_allowed")

    def presented_key(self, headers, bearer: bool = False) -> str | None:
        """The key the request presents: ``Authorization: Bearer`` with ``auth_method:
        bearer``, else the ``api_key_header``; ``bearer`` (a route family whose clients send
        only a bearer token, e.g. the OpenAI-compatible routes) reads the bearer token first,
        then the header."""
        if self.bearer or bearer:
            auth = headers.get("Authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            if self.bearer:
                return None
        return headers.get(self.header) or None

    def check_key(self, headers, now: datetime | None = None,
                  bearer: bool = False) -> ApiKey | None:
        """Return the matching :class:`ApiKey` (None when keys are disabled); ``bearer``: as
        :meth:`presented_key`.

        Raises :class:`Unauthorized` with code ``missing_api_key``,
        ``invalid_api_key`` or ``api_key_expired``.
        """
        if not self.key_check:
            return None
        key = self.presented_key(headers, bearer)
        if not key:
            how = "Authorization: Bearer <key>" if self.bearer or bearer \
                else f"{self.header}: <key>"
            raise Unauthorized(f"an API key is required ({how})", code="missing_api_key",
                               headers=self._challenge())
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        found = None
        for entry in self.keys:   # no early exit: compare against every key
            if hmac.compare_digest(digest, entry.sha256):
                found = entry
        if found is None:
            raise Unauthorized("invalid API key", code="invalid_api_key",
                               headers=self._challenge())
        if found.expires_at and (now or datetime.now(UTC)) >= found.expires_at:
            raise Unauthorized("API key expired", code="api_key_expired",
                               headers=self._challenge())
        return found

    def _challenge(self) -> dict:
        """The 401's ``WWW-Authenticate`` header (RFC 6750 §3) when keys come as bearer tokens."""
        return {"WWW-Authenticate": 'Bearer realm="hermes-service"'} if self.bearer else {}


def acting_user(api_key: ApiKey | None, requested: str | None) -> str | None:
    """The user (actor) a request acts for — the one actor-binding rule of every route
    family (docs/configuring.md §API keys): ``requested`` (already a valid id) or, when the request
    names none, the key's bound ``actor_id``. A key bound to an actor acts only for that actor:
    naming another raises :class:`Forbidden` ``actor_mismatch`` (each blueprint renders it in its
    contract's shape). Returns None when neither names a user."""
    bound = getattr(api_key, "actor_id", None)
    if bound and requested is not None and requested != bound:
        raise Forbidden("this API key is bound to another user", code="actor_mismatch")
    return requested if requested is not None else bound

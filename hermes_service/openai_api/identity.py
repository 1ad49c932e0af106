"""Who the user of an OpenAI-compatible request is (docs/openai-api.md §Who the user is).

* a key bound to a user (``security.api_keys[].user_id``, alias ``actor_id``) acts for that
  user; another user named by a trusted front end's header or token on it is still allowed
  only when the key is a trusted front end;
* a key marked ``trusted_frontend: true`` (Open WebUI's server, a gateway) names the user of
  each request: with ``openai.jwt_secret_env`` set, by Open WebUI's signed token
  ``X-OpenWebUI-User-Jwt`` (HS256 with that secret; ``exp`` required; the user id in ``id``,
  else ``sub``) — the plain header is then not believed —, otherwise by the header
  ``openai.user_header`` (default ``X-OpenWebUI-User-Id``); a request naming nobody falls back
  to the key's bound user;
* anything else — the body's ``user`` / ``safety_identifier`` alone, a header on a key that is
  not a trusted front end — names nobody: 403 ``user_required``.

The id must be a safe id (:func:`hermes_service.errors.check_id`: 400 ``invalid_id``).
"""
from __future__ import annotations

import os

import jwt
from flask import g, request

from ..errors import Forbidden, Unauthorized, check_id
from .settings import OpenAISettings

#: the header Open WebUI forwards its user's signed token in
JWT_HEADER = "X-OpenWebUI-User-Jwt"
#: clock skew allowed on the token's ``exp`` / ``nbf`` (seconds)
LEEWAY_SECONDS = 10


def user_of_request(cfg: OpenAISettings) -> str:
    """The acting user of this request (module doc). Raises Unauthorized
    (``invalid_user_token``), Forbidden (``user_required``) or BadRequest (``invalid_id``)."""
    key = g.get("api_key")
    bound = getattr(key, "actor_id", None)
    named = None
    if getattr(key, "trusted_frontend", False):
        named = _named_user(cfg)
    user = named or bound
    if not user:
        raise Forbidden("this API key names no user: bind it to one (security.api_keys[]."
                        "user_id) or mark it a trusted front end that names the user of each "
                        "request (trusted_frontend; docs/openai-api.md)", code="user_required")
    return check_id(user, "user")


def _named_user(cfg: OpenAISettings) -> str | None:
    """The user a trusted front end names: the verified token when a secret is configured,
    else the configured header; None when the request names none."""
    token = request.headers.get(JWT_HEADER)
    secret = os.environ.get(cfg.jwt_secret_env) if cfg.jwt_secret_env else None
    if cfg.jwt_secret_env:
        if not token:
            return None
        if not secret:
            raise Unauthorized(f"{JWT_HEADER} cannot be verified: {cfg.jwt_secret_env} is "
                               "unset in the service's environment", code="invalid_user_token")
        return _verified_user(token, secret)
    if cfg.user_header:
        return request.headers.get(cfg.user_header) or None
    return None


def _verified_user(token: str, secret: str) -> str:
    """The user id of Open WebUI's HS256 token ``token``; 401 ``invalid_user_token`` for a
    token that is malformed, signed otherwise, expired or names no user."""
    try:
        claims = jwt.decode(token, secret, algorithms=["HS256"], leeway=LEEWAY_SECONDS,
                            options={"require": ["exp"]})
    except jwt.PyJWTError as err:
        raise Unauthorized(f"{JWT_HEADER} is not a valid token ({type(err).__name__})",
                           code="invalid_user_token") from None
    user = claims.get("id") or claims.get("sub")
    if not isinstance(user, str) or not user:
        raise Unauthorized(f"{JWT_HEADER} names no user (claim id or sub)",
                           code="invalid_user_token")
    return user

"""Who the user of a request is (hermes_service/openai_api/identity.py): a bound key, a
trusted front end's header or verified token, nobody (in process, the CLI runner stubbed)."""
import time

import jwt

from .test_routes import CFG, FRONT, auth, chat, client, user  # noqa: F401 (client: fixture)

SECRET_ENV, SECRET = "OPENAI_TEST_JWT_SECRET", "s" * 40


def test_identity_rules(client, stub, monkeypatch):
    assert client.get("/v1/models").status_code == 401
    res = client.get("/v1/models", headers=auth("v1only-key-0123456789abcdef"))
    assert res.status_code == 403 and res.json["error"]["code"] == "insufficient_scope"
    # a key without a user, the body's user alone: nobody
    res = chat(client, [user("x")], auth("nouser-key-0123456789abcdef"), user="alice")
    assert res.status_code == 403 and res.json["error"]["code"] == "user_required"
    # a bound key that is no front end: the header is not believed
    chat(client, [user("x")], auth(**{"X-OpenWebUI-User-Id": "mallory"}))
    assert stub.calls[-1]["cwd"].user_id == "alice"
    # a trusted front end names its user
    chat(client, [user("x")], auth(FRONT, **{"X-OpenWebUI-User-Id": "carol"}))
    assert stub.calls[-1]["cwd"].user_id == "carol"
    res = chat(client, [user("x")], auth(FRONT))
    assert res.status_code == 403


def test_a_front_end_with_a_secret_names_users_by_verified_token(stubbed_app, stub,
                                                                 monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    client = stubbed_app({**CFG, "openai": {"runner": "cli",
                                            "jwt_secret_env": SECRET_ENV}}).test_client()
    good = jwt.encode({"id": "dave", "exp": int(time.time()) + 300}, SECRET, "HS256")
    chat(client, [user("x")], auth(FRONT, **{"X-OpenWebUI-User-Jwt": good}))
    assert stub.calls[-1]["cwd"].user_id == "dave"
    forged = jwt.encode({"id": "dave", "exp": int(time.time()) + 300}, "t" * 40, "HS256")
    expired = jwt.encode({"id": "dave", "exp": int(time.time()) - 100}, SECRET, "HS256")
    none_alg = jwt.encode({"id": "dave", "exp": int(time.time()) + 300}, None, "none")
    for token in (forged, expired, none_alg, "garbage"):
        res = chat(client, [user("x")], auth(FRONT, **{"X-OpenWebUI-User-Jwt": token}))
        assert res.status_code == 401 and res.json["error"]["code"] == "invalid_user_token"
    # the plain header is not believed once a secret is configured
    res = chat(client, [user("x")], auth(FRONT, **{"X-OpenWebUI-User-Id": "mallory"}))
    assert res.status_code == 403
    assert len(stub.calls) == 1

"""The model pass-through endpoint (hermes_service/model_proxy/).

Upstreams: the suite's scripted model (hermes_service/scripted_model/: records every chat-completions
request's headers, answers ``[[status:N]]`` / ``[[hang]]`` directives, reports ``usage``) and a
small gated upstream here that records any request and streams a reply whose second half waits
for the test's go-ahead (so "relayed before the provider finished" is a condition, not a
timing); it can also serve TLS (a throw-away self-signed certificate from the ``openssl``
command) for the tests of an upstream reached through an HTTP proxy (tests/support/recording_proxy.py).
The last two tests run the real ``hermes chat`` through the endpoint.
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hermes_service import metrics
from hermes_service.model_proxy.policy import ROUTES
from hermes_service.model_proxy.proxy import ModelProxy
from hermes_service.model_proxy.upstream import upstream_proxy_for
from hermes_service.model_proxy.usage import UsageReader, UsageStore, read_usage, usage_db_path
from hermes_service.runner import classify_text
from hermes_service.scripted_model import ScriptedModel
from support.fixtures import ROOT, base_config, free_port, wait_for
from support.recording_proxy import RecordingProxy

KEY_ENV = "MODEL_PROXY_TEST_PROVIDER_KEY"
REAL_KEY = "sk-real-provider-key-7f3a"


# -- helpers ---------------------------------------------------------------------------
def usage_rows(proxy, expected_requests, **kw):
    """The proxy's usage rows once ``expected_requests`` are recorded: the caller may have
    the last byte of an answer a moment before the proxy counts it (metric first, then db)."""
    def total():
        proxy.usage.flush()
        return sum(r.requests for r in read_usage(proxy.usage.path))
    wait_for(lambda: total() >= expected_requests, what=f"{expected_requests} recorded requests")
    return read_usage(proxy.usage.path, **kw)


def tokens(kind):
    return metrics.REGISTRY.get_sample_value("hermes_service_model_tokens_total",
                                             {"kind": kind}) or 0.0


def outcome_count(outcome):
    return metrics.REGISTRY.get_sample_value("hermes_service_model_requests_total",
                                             {"outcome": outcome}) or 0.0


def chat_body(text, stream=False, usage=True, **kw):
    body = {"model": "scripted-model", "stream": stream,
            "messages": [{"role": "user", "content": text}], **kw}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


class Client:
    """One keep-alive HTTP/1.1 connection to the proxy (http.client, like a provider SDK)."""

    def __init__(self, proxy, timeout=15):
        self.conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=timeout)

    def request(self, method, path, body=None, credential=None, headers=None):
        h = dict(headers or {})
        if credential is not None:
            h["Authorization"] = f"Bearer {credential}"
        if body is not None:
            h.setdefault("Content-Type", "application/json")
        self.conn.request(method, path, body, h)
        return self.conn.getresponse()

    def call(self, *a, **kw):
        resp = self.request(*a, **kw)
        return resp.status, dict(resp.getheaders()), resp.read()

    def close(self):
        self.conn.close()


def sse_usage(raw: bytes) -> dict:
    """The usage object of a relayed OpenAI stream (what the provider reported)."""
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            obj = json.loads(line[6:])
            if obj.get("usage"):
                return obj["usage"]
    raise AssertionError(f"no usage in {raw[:300]!r}")


class Gated:
    """Test upstream: records each request (method, path, headers, body); answers:

    * a POST whose body holds ``"gated"``: an SSE answer, chunked; the first event at once,
      the second only after :attr:`release` is set, then a usage event and ``[DONE]``;
      :attr:`finished` is set after the last byte;
    * a POST whose body holds ``"cut"``: an SSE answer with two content events (``"0123456789"``
      each), then the connection is closed without the usage event or the last chunk; one
      holding ``"nousage"``: a whole JSON answer without ``usage``;
    * any request while :attr:`redirect` is true: 307 to ``<base>/api/v1/elsewhere?x=1``;
    * anything else: 200 JSON ``{"method", "path", "headers"}`` (what it received).

    ``tls``: a server-side SSL context to serve HTTPS with (``base`` is then ``https://…``).
    """

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.seen: list[dict] = []
        self.release = threading.Event()
        self.finished = threading.Event()
        self.redirect = False
        gated = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                gated.seen.append({"method": self.command, "path": self.path,
                                   "headers": self.headers.items(), "body": body})
                if self.command == "POST" and b"cut" in body:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for _ in range(2):
                        b = b'data: {"choices": [{"delta": {"content": "0123456789"}}]}\n\n'
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command == "POST" and b"nousage" in body:
                    out = json.dumps({"choices": [{"message": {"role": "assistant",
                                                               "content": "x" * 40}}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                if self.command == "POST" and b"gated" in body:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.send_header("X-Upstream", "gated")
                    self.end_headers()

                    def chunk(b):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
                        self.wfile.flush()
                    chunk(b'data: {"choices": [{"delta": {"content": "first"}}]}\n\n')
                    gated.release.wait(20)
                    chunk(b'data: {"choices": [{"delta": {"content": "second"}}]}\n\n')
                    chunk(b'data: {"choices": [], "usage": {"prompt_tokens": 11, '
                          b'"completion_tokens": 7, "total_tokens": 18}}\n\ndata: [DONE]\n\n')
                    chunk(b"")
                    gated.finished.set()
                    return
                if gated.redirect:
                    self.send_response(307)
                    self.send_header("Location", gated.base + "/api/v1/elsewhere?x=1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                out = json.dumps({"method": self.command, "path": self.path,
                                  "headers": self.headers.items()}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = do_PUT = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.base = (f"{'https' if tls is not None else 'http'}://127.0.0.1:"
                     f"{self.server.server_address[1]}")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


# -- fixtures ----------------------------------------------------------------------------
@pytest.fixture
def tls_gated(tmp_path, monkeypatch):
    """A :class:`Gated` upstream on HTTPS whose self-signed certificate (for 127.0.0.1) the
    proxy trusts through ``SSL_CERT_FILE``."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    g = Gated(tls=ctx)
    yield g
    g.stop()


@pytest.fixture(autouse=True)
def provider_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, REAL_KEY)


@pytest.fixture
def scripted():
    m = ScriptedModel("scripted-model").start()
    yield m
    m.stop()


@pytest.fixture
def gated():
    g = Gated()
    yield g
    g.stop()


@pytest.fixture
def make_proxy(tmp_path):
    started = []

    def make(upstream, key_env=KEY_ENV, **kw):
        kw.setdefault("models", {"scripted-model"})
        p = ModelProxy(upstream, key_env, usage_db_path(tmp_path / "data"), **kw).start()
        started.append(p)
        return p
    yield make
    for p in started:
        p.stop()


# -- credentials --------------------------------------------------------------------------
def test_a_missing_unknown_or_revoked_credential_gets_401_and_is_never_forwarded(
        scripted, make_proxy):
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("alice")
    c = Client(proxy)
    status, _, raw = c.call("POST", "/v1/chat/completions", chat_body("ok"), cred)
    assert status == 200 and len(scripted.requests) == 1
    proxy.revoke(cred)
    before = outcome_count("unauthorized")
    for headers in ({}, {"Authorization": "Bearer not-a-credential"},
                    {"Authorization": f"Bearer {cred}"},                 # revoked
                    {"Authorization": f"Basic {cred}"}, {"Authorization": "Bearer "},
                    {"Authorization": f"Bearer {REAL_KEY}"}):           # the provider's key
        status, h, raw = c.call("POST", "/v1/chat/completions", chat_body("never"),
                                headers=headers)
        assert status == 401, headers
        assert json.loads(raw) == {"error": {
            "message": json.loads(raw)["error"]["message"], "type": "invalid_request_error",
            "param": None, "code": "invalid_api_key"}}
        assert h["Content-Type"] == "application/json"
    assert len(scripted.requests) == 1            # nothing after the first reached the provider
    assert outcome_count("unauthorized") == before + 6
    other = proxy.issue("alice")                  # one process's revoke leaves the others
    assert c.call("POST", "/v1/chat/completions", chat_body("again"), other)[0] == 200
    assert proxy.issue("alice") != other


def test_credentials_stay_valid_across_many_requests_until_revoked(scripted, make_proxy):
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("bob")
    c = Client(proxy)
    for i in range(5):            # a warm process: many turns on one credential
        assert c.call("POST", "/v1/chat/completions", chat_body(f"turn {i}"), cred)[0] == 200
    proxy.revoke(cred)
    assert c.call("POST", "/v1/chat/completions", chat_body("late"), cred)[0] == 401


# -- forwarding -----------------------------------------------------------------------------
def test_the_upstream_sees_the_real_key_and_only_the_headers_it_needs(scripted, make_proxy):
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("alice")
    status, _, _ = Client(proxy).call(
        "POST", "/v1/chat/completions", chat_body("key check"), cred,
        headers={"X-Stainless-Lang": "python", "Connection": "keep-alive, X-Hop-Named",
                 "X-Hop-Named": "drop me", "Keep-Alive": "timeout=5", "TE": "trailers",
                 "Proxy-Authorization": "Basic c2VjcmV0", "Upgrade": "h2c",
                 "Accept-Encoding": "gzip, deflate, br, zstd", "x-api-key": "sk-other",
                 "api-key": "sk-other", "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Host": "a",
                 "Forwarded": "for=10.0.0.1", "Cookie": "s=1", "OpenAI-Organization": "org-x",
                 "OpenAI-Project": "proj-x", "Anthropic-Version": "2023-06-01",
                 "Content-Type": "application/json; charset=utf-8"})
    assert status == 200
    [headers] = scripted.request_headers
    assert headers["Authorization"] == f"Bearer {REAL_KEY}"
    assert all(cred not in v for v in headers.values()), headers
    assert headers["X-Stainless-Lang"] == "python"                      # the SDK's own kept
    assert headers["Host"] == scripted.base_url.split("/")[2]          # the upstream's host
    assert headers["Accept-Encoding"] == "identity"                     # what usage can read
    assert headers["Content-Type"] == "application/json"
    assert {k.lower() for k in headers} <= {
        "host", "authorization", "content-length", "content-type", "accept-encoding",
        "accept", "user-agent", "x-stainless-lang"}, headers


def test_only_the_model_routes_are_forwarded_and_the_key_is_read_per_request(
        gated, make_proxy, monkeypatch):
    proxy = make_proxy(gated.base + "/api/v1")
    cred = proxy.issue("alice")
    c = Client(proxy)
    before = outcome_count("refused")
    for method, path in (("GET", "/v1/models/x"), ("GET", "/v1/models?limit=2"),
                         ("GET", "/v1/models/"), ("GET", "/v1//models"), ("GET", "/v1/Models"),
                         ("GET", "/v1/%6dodels"), ("GET", "/v1/props"), ("GET", "/props"),
                         ("DELETE", "/v1/files/f1"), ("POST", "/v1/files"),
                         ("POST", "/v1/fine_tuning/jobs"), ("GET", "/v1/organization/admin_api_keys"),
                         ("POST", "/v1/responses"), ("POST", "/v1/embeddings"),
                         ("POST", "/v1/chat/completions?x=1"), ("GET", "/v1/../v1/models"),
                         ("GET", "/v1/./models"), ("GET", "/v1/models%2F..%2Fadmin"),
                         ("GET", "http://127.0.0.1/v1/models")):
        status, _, raw = c.call(method, path, credential=cred)
        assert (status, json.loads(raw)["error"]["code"]) == (404, "not_found"), path
    for method, path in (("POST", "/v1/models"), ("GET", "/v1/chat/completions"),
                         ("DELETE", "/v1/models"), ("HEAD", "/v1/models")):
        resp = c.request(method, path, credential=cred)
        resp.read()
        assert (resp.status, resp.getheader("Allow")) == (405, ROUTES[path]), (method, path)
    assert gated.seen == []                                  # none reached the provider
    assert outcome_count("refused") == before + 4            # the 404s are not counted
    status, _, raw = c.call("GET", "/v1/models", credential=cred)
    assert status == 200
    got = json.loads(raw)
    assert (got["method"], got["path"]) == ("GET", "/api/v1/models")
    assert ["Authorization", f"Bearer {REAL_KEY}"] in got["headers"]
    monkeypatch.setenv(KEY_ENV, "sk-rotated")                          # read at request time
    got = json.loads(c.call("GET", "/v1/models", credential=cred)[2])
    assert ["Authorization", "Bearer sk-rotated"] in got["headers"]
    monkeypatch.delenv(KEY_ENV)                                        # unset: no header at all
    got = json.loads(c.call("GET", "/v1/models", credential=cred)[2])
    assert not [h for h in got["headers"] if h[0].lower() == "authorization"]
    gated.redirect = True
    status, headers, _ = c.call("GET", "/v1/models", credential=cred)  # back to us, not them
    assert (status, headers["Location"]) == (307, proxy.base_url + "/elsewhere?x=1")


def test_no_key_env_sends_no_authorization(gated, make_proxy):
    proxy = make_proxy(gated.base + "/v1", key_env=None)
    got = json.loads(Client(proxy).call("GET", "/v1/models", credential=proxy.issue("a"))[2])
    assert not [h for h in got["headers"] if h[0].lower() == "authorization"]


def test_configure_reloads_the_upstream_and_key_for_new_requests(scripted, gated, make_proxy,
                                                                monkeypatch):
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("alice")
    c = Client(proxy)
    assert c.call("POST", "/v1/chat/completions", chat_body("old"), cred)[0] == 200
    monkeypatch.setenv("OTHER_KEY_ENV", "sk-other")
    proxy.configure(gated.base + "/v1", "OTHER_KEY_ENV", read_timeout=30)
    got = json.loads(c.call("GET", "/v1/models", credential=cred)[2])
    assert got["path"] == "/v1/models" and ["Authorization", "Bearer sk-other"] in got["headers"]
    assert len(scripted.requests) == 1
    with pytest.raises(ValueError):
        proxy.configure("ftp://nope", None)
    proxy.configure(None, None)                                       # no provider: 502
    status, _, raw = c.call("GET", "/v1/models", credential=cred)
    assert status == 502 and "model provider unreachable" in json.loads(raw)["error"]["message"]


def test_bad_and_oversized_bodies_are_refused(scripted, make_proxy, monkeypatch):
    from hermes_service.model_proxy import limits
    monkeypatch.setattr(limits, "LINGER_SECONDS", 0.2)    # the body never comes here
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("alice")
    assert Client(proxy).call("GET", "/admin", credential=cred)[0] == 404
    # chunked request body → 411 (Content-Length is what httpx sends)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer " + cred.encode() + b"\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 411 ")
    # over the cap → 413 (after the body sent is read and dropped); two lengths that differ
    # → 400
    for head in (b"Content-Length: %d\r\n" % (proxy.policy.max_body + 1),
                 b"Content-Length: 2\r\nContent-Length: 3\r\n", b"Content-Length: +2\r\n"):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Authorization: Bearer " + cred.encode() + b"\r\n" + head + b"\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 4"), head
    assert proxy.policy.max_body == 4 * 1024 * 1024          # 32 bytes x 128 000 tokens
    assert scripted.requests == []


# -- streaming ------------------------------------------------------------------------------
def test_a_stream_is_relayed_chunk_by_chunk_before_the_provider_finishes(gated, make_proxy):
    proxy = make_proxy(gated.base + "/v1")
    cred = proxy.issue("alice")
    c = Client(proxy, timeout=10)      # a buffering proxy would never give the first chunk
    resp = c.request("POST", "/v1/chat/completions", chat_body("gated", stream=True), cred)
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    assert resp.getheader("X-Upstream") == "gated"
    first = resp.read1(65536)
    assert b"first" in first and b"second" not in first
    assert not gated.release.is_set() and not gated.finished.is_set()   # provider still waiting
    gated.release.set()
    rest = resp.read()
    assert b"second" in rest and rest.endswith(b"data: [DONE]\n\n")
    assert gated.finished.wait(10)      # (set just after its last byte)
    assert usage_rows(proxy, 1) == [("alice", None, 1, 11, 7, 0)]


def test_a_scripted_stream_and_json_answers_come_back_byte_for_byte(scripted, make_proxy):
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("alice")
    c = Client(proxy)
    resp = c.request("POST", "/v1/chat/completions",
                     chat_body("pieces [[slow:0.2:4]]", stream=True), cred)
    assert resp.getheader("Transfer-Encoding") == "chunked"     # our own framing of it
    raw = resp.read()
    frames = [f for f in raw.split(b"\n\n") if f]
    assert frames[-1] == b"data: [DONE]"
    text = "".join(json.loads(f[6:])["choices"][0]["delta"].get("content") or ""
                   for f in frames[:-1] if json.loads(f[6:])["choices"])
    assert text == "echo #1: pieces [[slow:0.2:4]]"
    status, headers, raw = c.call("GET", "/v1/models", credential=cred)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "scripted-model"
    assert headers["Content-Length"] == str(len(raw))


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [401, 429, 500])
def test_provider_error_statuses_and_bodies_pass_through(scripted, make_proxy, code):
    proxy = make_proxy(scripted.base_url)
    body = chat_body(f"[[status:{code}]]", stream=True)
    direct = http.client.HTTPConnection("127.0.0.1", int(scripted.base_url.split(":")[2][:-3]))
    direct.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    want = direct.getresponse()
    want_body, want_headers = want.read(), dict(want.getheaders())
    status, headers, raw = Client(proxy).call("POST", "/v1/chat/completions", body,
                                              proxy.issue("alice"))
    assert (status, raw) == (want.status, want_body) == (code, want_body)
    assert headers["Content-Type"] == want_headers["Content-Type"] == "application/json"
    if code == 429:
        assert headers["Retry-After"] == "1"
    assert json.loads(raw)["error"]["message"] == f"scripted HTTP {code} error"


def test_an_unreachable_provider_gets_502_in_openai_shape(make_proxy):
    proxy = make_proxy(f"http://127.0.0.1:{free_port()}/v1")      # nothing listens there
    before = outcome_count("unreachable")
    status, headers, raw = Client(proxy).call("POST", "/v1/chat/completions", chat_body("x"),
                                              proxy.issue("alice"))
    assert status == 502 and headers["Content-Type"] == "application/json"
    err = json.loads(raw)["error"]
    assert err["message"].startswith("model provider unreachable")
    assert (err["type"], err["code"]) == ("server_error", "upstream_unreachable")
    assert outcome_count("unreachable") == before + 1


def test_a_provider_that_does_not_answer_in_read_timeout_gets_504(scripted, make_proxy):
    proxy = make_proxy(scripted.base_url, read_timeout=0.5)
    status, _, raw = Client(proxy).call("POST", "/v1/chat/completions",
                                        chat_body("[[hang]]", stream=True), proxy.issue("a"))
    assert status == 504 and json.loads(raw)["error"]["code"] == "upstream_timeout"
    assert classify_text(f"API call failed: HTTP 504: {json.loads(raw)['error']['message']}"
                         ).code == "upstream_unavailable"


def test_a_caller_that_leaves_before_the_answer_is_still_billed_what_the_provider_reports(
        scripted, make_proxy):
    """The provider bills a request whether or not its caller waits (a Hermes process killed,
    an agent hanging up on purpose): its answer is still awaited and read to its usage."""
    proxy = make_proxy(scripted.base_url)
    c = Client(proxy)
    c.conn.request("POST", "/v1/chat/completions",
                   chat_body("[[gate:left]] [[usage:50000]]", stream=True),
                   {"Authorization": f"Bearer {proxy.issue('alice')}",
                    "Content-Type": "application/json"})
    wait_for(lambda: len(scripted.requests) == 1, what="the request to reach the provider")
    c.close()                                          # e.g. the Hermes process was killed
    time.sleep(0.3)        # (the proxy notices the hang-up; nothing to wait on but time)
    assert len(scripted._conns) == 1                   # the upstream request is kept
    scripted.release("left")
    [row] = usage_rows(proxy, 1)
    assert (row.prompt_tokens, row.estimated_requests) == (50000, 0)
    wait_for(lambda: not scripted._conns, what="the upstream connection closed after")


# -- usage ----------------------------------------------------------------------------------
def test_usage_is_counted_per_user_in_the_db_and_the_counter(scripted, make_proxy, caplog):
    proxy = make_proxy(scripted.base_url)
    a, b = proxy.issue("alice"), proxy.issue("bob")
    c = Client(proxy)
    p0, _c0 = tokens("prompt"), tokens("completion")
    want = {"alice": [0, 0, 0], "bob": [0, 0, 0]}
    caplog.set_level(logging.DEBUG, logger="hermes_service.model_proxy")
    for user, cred, body, streamed in (
            ("alice", a, chat_body("one", stream=True), True),
            ("alice", a, chat_body("two [[usage:5000]]", stream=True), True),
            ("bob", b, chat_body("three"), False),
            ("bob", b, chat_body("no usage asked", stream=True, usage=False), "hidden"),
            ("bob", b, chat_body("[[status:429]]", stream=True), None)):
        status, _, raw = c.call("POST", "/v1/chat/completions", body, cred)
        if streamed == "hidden":      # counted all the same; the caller did not ask to see it
            assert b'"usage": {' not in raw and raw.endswith(b"data: [DONE]\n\n"), raw
            asked = json.loads(body)
            asked["stream_options"] = {"include_usage": True}
            status, _, raw = Client(proxy).call("POST", "/v1/chat/completions",
                                                json.dumps(asked).encode(), proxy.issue("x"))
        u = (sse_usage(raw) if streamed else json.loads(raw)["usage"]) if streamed is not None \
            else {"prompt_tokens": 0, "completion_tokens": 0}
        w = want[user]
        w[0] += 1
        w[1] += u["prompt_tokens"]
        w[2] += u["completion_tokens"]
        if streamed == "hidden":
            hidden = u["prompt_tokens"]          # counted twice: for bob and for x
    assert want["alice"][1] > 5000
    rows = {r.user_id: list(r[2:5]) for r in usage_rows(proxy, 6) if r.user_id != "x"}
    assert rows == want
    assert tokens("prompt") - p0 == want["alice"][1] + want["bob"][1] + hidden
    assert [r.user_id for r in read_usage(proxy.usage.path, user_id="bob", daily=True)] == ["bob"]
    # one debug line per forwarded request, without the key or any credential (logged once the
    # request is over: a moment after its usage is recorded)
    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "hermes_service.model_proxy"]
    wait_for(lambda: len(lines()) >= 6, "six request lines")
    lines = lines()
    assert len(lines) == 6 and "user=bob POST /v1/chat/completions status=429" in lines[-1]
    assert " ms=" in lines[-1]
    assert all(s not in caplog.text for s in (a, b, REAL_KEY))


def test_the_usage_reader_takes_gzip_streams_split_usage_and_json_bodies():
    import gzip
    sse = (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
           b'event: message_start\ndata: {"type": "message_start", "message": {"usage": '
           b'{"input_tokens": 40, "output_tokens": 1}}}\n\n'
           b'data: {"type": "message_delta", "usage": {"output_tokens": 9}}\n\n'
           b'data: [DONE]\n\n')
    packed = gzip.compress(sse)
    r = UsageReader("text/event-stream; charset=utf-8", "gzip")
    for i in range(0, len(packed), 7):                    # pieces cut anywhere
        r.feed(packed[i:i + 7])
    assert r.tokens() == (40, 9)
    r = UsageReader("application/json", None)
    body = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    r.feed(body[:5])
    r.feed(body[5:])
    assert r.tokens() == (3, 4)
    for ctype, enc, data in (("text/plain", None, body), ("application/json", "br", body),
                             ("application/json", None, b"{not json")):
        r = UsageReader(ctype, enc)
        r.feed(data)
        assert r.tokens() == (0, 0)


def test_two_processes_add_to_one_usage_db_without_losing_counts(tmp_path):
    db = tmp_path / "data" / "model_usage.db"
    code = ("import sys; from pathlib import Path; "
            "from hermes_service.model_proxy.usage import UsageStore; "
            "s = UsageStore(Path(sys.argv[1]))\n"
            "for i in range(300): s.add('carol', 2, 3); s.flush() if i % 7 == 0 else None\n"
            "s.close()")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(db)], cwd=str(ROOT))
             for _ in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    assert read_usage(db) == [("carol", None, 600, 1200, 1800, 0)]


def test_the_usage_command_prints_a_table_per_user(tmp_path):
    cfg = base_config(tmp_path)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    from hermes_service.cli import cli
    runner = CliRunner()
    res = runner.invoke(cli, ["--config", str(path), "usage"])
    assert res.exit_code == 0 and "no model usage recorded" in res.output, res.output
    store = UsageStore(usage_db_path(Path(cfg["paths"]["data_dir"])))
    import datetime as dt
    today = dt.datetime.now(dt.UTC).date()
    store.add("alice", 100, 20)
    store.add("alice", 50, 5)
    store.add("bob", 7, 3)
    store.add("bob", 1000, 1000, day=(today - dt.timedelta(days=10)).isoformat())
    store.close()
    res = runner.invoke(cli, ["--config", str(path), "usage", "--days", "7"])
    assert res.exit_code == 0, res.output
    table = [ln.split() for ln in res.output.splitlines()[1:]]
    assert table == [["user", "requests", "prompt_tokens", "completion_tokens", "total_tokens",
                      "estimated"],
                     ["alice", "2", "150", "25", "175", "0"], ["bob", "1", "7", "3", "10", "0"],
                     ["(total)", "3", "157", "28", "185", "0"]]
    res = runner.invoke(cli, ["--config", str(path), "usage", "--user", "bob", "--days", "30",
                              "--daily"])
    table = [ln.split() for ln in res.output.splitlines()[2:]]
    assert [r[0] for r in table] == ["bob", "bob", "(total)"], res.output
    assert table[0][1] < table[1][1] and table[-1][1:] == ["2", "1007", "1003", "2010", "0"]
    assert runner.invoke(cli, ["--config", str(path), "usage", "--days", "0"]).exit_code == 2


# -- an upstream HTTP proxy ------------------------------------------------------------------
P = "http://proxy.internal:3128"


@pytest.mark.parametrize("env, url, expected", [
    (None, "https://api.example.com/v1", None),
    ({}, "https://api.example.com/v1", None),
    ({"HTTPS_PROXY": P}, None, None),
    ({"HTTPS_PROXY": P}, "ftp://api.example.com/v1", None),
    ({"HTTPS_PROXY": P}, "https://api.example.com/v1", P),
    ({"https_proxy": f" {P} "}, "https://api.example.com/v1", P),
    ({"HTTPS_PROXY": P}, "http://api.example.com/v1", None),            # per scheme
    ({"HTTP_PROXY": P}, "http://api.example.com/v1", P),
    ({"HTTP_PROXY": P}, "https://api.example.com/v1", None),
    ({"https_proxy": "http://lower:1", "HTTPS_PROXY": "http://upper:1"},
     "https://api.example.com/v1", "http://lower:1"),                    # lower-case first
    ({"https_proxy": "", "HTTPS_PROXY": P}, "https://api.example.com/v1", P),   # empty: unset
    ({"ALL_PROXY": P}, "https://api.example.com/v1", P),                 # the fallback
    ({"all_proxy": P}, "http://api.example.com/v1", P),
    ({"ALL_PROXY": "http://all:1", "HTTPS_PROXY": P}, "https://api.example.com/v1", P),
    ({"HTTPS_PROXY": P, "NO_PROXY": "example.com"}, "https://api.example.com/v1", None),
    ({"HTTPS_PROXY": P, "NO_PROXY": "other.org, .Example.COM"},
     "https://API.example.com/v1", None),
    ({"HTTPS_PROXY": P, "NO_PROXY": "example.com"}, "https://example.com/v1", None),
    ({"HTTPS_PROXY": P, "NO_PROXY": "ample.com"}, "https://api.example.com/v1", P),
    ({"HTTPS_PROXY": P, "NO_PROXY": "*"}, "https://api.example.com/v1", None),
    ({"HTTPS_PROXY": P, "NO_PROXY": "api.example.com:8443"},
     "https://api.example.com:8443/v1", None),
    ({"HTTPS_PROXY": P, "NO_PROXY": "api.example.com:8443"}, "https://api.example.com/v1", P),
    ({"HTTPS_PROXY": P, "no_proxy": "other.org", "NO_PROXY": "example.com"},
     "https://api.example.com/v1", P),                                   # lower-case first
    ({"HTTP_PROXY": P, "NO_PROXY": "localhost,127.0.0.1"}, "http://127.0.0.1:8000/v1", None),
    ({"HTTP_PROXY": P, "NO_PROXY": "::1"}, "http://[::1]:8000/v1", None),
    ({"HTTP_PROXY": P}, "http://127.0.0.1:8000/v1", P),          # loopback is not implied
])
def test_upstream_proxy_for_picks_the_proxy_like_curl_and_requests(env, url, expected):
    assert upstream_proxy_for(env, url) == expected


def test_an_http_upstream_goes_through_the_proxy_with_the_absolute_uri_and_credentials(
        gated, make_proxy):
    with RecordingProxy(auth=("svc", "p@ss:w")) as rp:
        proxy = make_proxy(gated.base + "/v1",
                           upstream_proxy=rp.url.replace("http://", "http://svc:p%40ss%3Aw@"))
        cred = proxy.issue("alice")
        c = Client(proxy, timeout=10)
        resp = c.request("POST", "/v1/chat/completions", chat_body("via proxy gated",
                                                                   stream=True), cred)
        assert resp.status == 200 and resp.getheader("X-Upstream") == "gated"
        first = resp.read1(65536)                   # still relayed chunk by chunk
        assert b"first" in first and b"second" not in first and not gated.finished.is_set()
        gated.release.set()
        assert resp.read().endswith(b"data: [DONE]\n\n")
        netloc = gated.base.split("//", 1)[1]
        [(method, target, fields)] = rp.requests    # absolute-form: the proxy saw the target
        assert (method, target) == ("POST", netloc)
        assert fields["proxy-authorization"] == "Basic " + base64.b64encode(
            b"svc:p@ss:w").decode()
        [seen] = gated.seen
        headers = {k.lower(): v for k, v in seen["headers"]}
        assert seen["path"] == "/v1/chat/completions" and headers["host"] == netloc
        assert headers["authorization"] == f"Bearer {REAL_KEY}"
        assert all(cred not in v for v in headers.values())
        assert usage_rows(proxy, 1) == [("alice", None, 1, 11, 7, 0)]


def test_an_https_upstream_is_tunnelled_with_connect_and_not_pooled_with_direct_ones(
        tls_gated, make_proxy):
    netloc = tls_gated.base.split("//", 1)[1]
    with RecordingProxy(auth=("u", "pw")) as rp:
        proxy = make_proxy(tls_gated.base + "/v1",
                           upstream_proxy=rp.url.replace("http://", "http://u:pw@"))
        cred = proxy.issue("alice")
        c = Client(proxy)
        for _ in range(2):
            status, _, raw = c.call("GET", "/v1/models", credential=cred)
            assert status == 200, raw
            got = json.loads(raw)
            assert got["path"] == "/v1/models"
            headers = {k.lower(): v for k, v in got["headers"]}
            assert headers["host"] == netloc and headers["authorization"] == f"Bearer {REAL_KEY}"
            assert "proxy-authorization" not in headers       # the CONNECT's only
        [(method, target, fields)] = rp.requests       # one tunnel, reused for the second
        assert (method, target) == ("CONNECT", netloc)
        assert fields["proxy-authorization"] == "Basic " + base64.b64encode(b"u:pw").decode()
        proxy.configure(tls_gated.base + "/v1", KEY_ENV)                   # now direct
        assert c.call("GET", "/v1/models", credential=cred)[0] == 200
        assert len(rp.requests) == 1 and len(tls_gated.seen) == 3
        proxy.configure(tls_gated.base + "/v1", KEY_ENV, upstream_proxy=rp.url)   # no creds
        status, _, raw = c.call("GET", "/v1/models", credential=cred)
        assert status == 502 and json.loads(raw)["error"]["code"] == "upstream_unreachable"
        assert len(rp.requests) == 2 and len(tls_gated.seen) == 3      # 407: never direct


def test_an_unusable_or_unreachable_proxy_gets_502_and_nothing_goes_direct(gated, make_proxy,
                                                                          caplog):
    caplog.set_level(logging.WARNING, logger="hermes_service.model_proxy")
    proxy = make_proxy(gated.base + "/v1", upstream_proxy="socks5://u:s3cret@127.0.0.1:1080")
    cred = proxy.issue("alice")
    c = Client(proxy)
    for url in ("socks5://u:s3cret@127.0.0.1:1080", "https://u:s3cret@127.0.0.1:3128",
                "http://u:s3cret@:3128", "http://u:s3cret@127.0.0.1:nope",
                f"http://u:s3cret@127.0.0.1:{free_port()}"):                # nothing listens
        proxy.configure(gated.base + "/v1", KEY_ENV, upstream_proxy=url)
        status, _, raw = c.call("POST", "/v1/chat/completions", chat_body("x"), cred)
        err = json.loads(raw)["error"]
        assert (status, err["code"]) == (502, "upstream_unreachable"), url
        assert err["message"].startswith("model provider unreachable"), err
        assert "s3cret" not in err["message"]
    assert gated.seen == []
    assert "unusable upstream proxy" in caplog.text and "s3cret" not in caplog.text

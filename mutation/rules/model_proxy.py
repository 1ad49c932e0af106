"""Group ``model_proxy``: the pass-through (hermes_service/model_proxy/) and what it forwards
(model_proxy/policy.py); the credential's revocation when its process ends (sandbox/launcher.py)."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="model_proxy")
PX = "hermes_service/model_proxy/proxy.py"
HD = "hermes_service/model_proxy/handler.py"
RL = "hermes_service/model_proxy/relay.py"
REQ = "hermes_service/model_proxy/request.py"
MP = "hermes_service/model_proxy/policy.py"
RULES = ["tests/unit/model_proxy/test_rules.py"]
POLICY = ["tests/unit/model_proxy/test_policy.py", "-k", "not trickled"]
HTTP = ["tests/unit/model_proxy/test_proxy.py",
        "--deselect", "tests/unit/model_proxy/test_proxy.py::"
        "test_two_processes_add_to_one_usage_db_without_losing_counts"]
ARGS = ["tests/unit/sandbox/test_args.py"]

MUTANTS = [
    # -- the credential ------------------------------------------------------------------
    H("any Authorization scheme is accepted", PX,
      'if scheme.lower() != "bearer" or not token.strip():', "if not token.strip():", RULES),
    H("the Basic scheme is accepted too", PX,
      'if scheme.lower() != "bearer" or not token.strip():',
      'if scheme.lower() not in ("bearer", "basic") or not token.strip():', RULES),
    H("the scheme is case-sensitive", PX,
      'if scheme.lower() != "bearer" or not token.strip():',
      'if scheme != "Bearer" or not token.strip():', RULES),
    H("a revoked credential stays valid", PX,
      "            self._creds.pop(_digest(credential), None)\n", "            pass\n", RULES),
    H("a credential is the user's name", PX, 'credential = "hsm-" + secrets.token_urlsafe(32)',
      'credential = "hsm-" + user_id', RULES),
    H("a credential has 32 bits", PX, 'credential = "hsm-" + secrets.token_urlsafe(32)',
      'credential = "hsm-" + secrets.token_urlsafe(4)', RULES),
    H("the credential's process ending does not revoke it", "hermes_service/sandbox/launcher.py",
      "            on_close.append(lambda: credentials.revoke(token))\n", "", ARGS),
    H("a closed launch does not run its cleanups", "hermes_service/sandbox/launcher.py",
      "        for fn in self._on_close:\n            try:\n                fn()",
      "        for fn in ():\n            try:\n                fn()", ARGS),
    # -- what is held at once --------------------------------------------------------------
    H("one request more per user", PX,
      "if self._inflight.get(user_id, 0) >= limits.MAX_USER_REQUESTS or",
      "if self._inflight.get(user_id, 0) > limits.MAX_USER_REQUESTS or", RULES),
    H("a user's body bytes unbounded", PX,
      "self._user_bytes.get(user_id, 0) + length > user_body_budget(self.policy):",
      "self._user_bytes.get(user_id, 0) > user_body_budget(self.policy):", RULES),
    H("every user's body bytes unbounded", PX,
      "elif self._body_bytes + length > limits.BODY_BUDGET:",
      "elif self._body_bytes > limits.BODY_BUDGET:", RULES),
    H("a finished request keeps its body bytes", PX,
      "                self._body_bytes -= length\n", "                pass\n", RULES),
    H("a finished request keeps its place", PX,
      "                    self._inflight[user_id] = left\n", "                    pass\n", RULES),
    H("the budget allows one more request at its end", PX, "        if spent + held >= budget:",
      "        if spent + held > budget:", RULES),
    H("the budget is never checked at intake", HD, "            proxy.check_budget(user)\n",
      "", POLICY),
    # -- the intake ----------------------------------------------------------------------
    H("a request without a credential is forwarded", HD, "            if user is None:\n",
      "            if user is None and False:\n", HTTP),
    H("a body over the cap is read", HD, "        if length > cap:", "        if length > cap * 2:",
      HTTP),
    H("a chunked body is accepted", HD, '        if self.headers.get("Transfer-Encoding"):\n'
      "            self.close_connection = True\n            raise Refusal(411",
      '        if False:\n            self.close_connection = True\n            raise Refusal(411',
      HTTP),
    H("a POST body is not checked by the policy", HD, '            if self.command == "POST":',
      '            if self.command == "PUT":', HTTP),
    # -- the policy ---------------------------------------------------------------------
    H("the legacy completions route is forwarded", MP,
      'ROUTES = {"/v1/chat/completions": "POST", "/v1/models": "GET"}',
      'ROUTES = {"/v1/chat/completions": "POST", "/v1/models": "GET", "/v1/completions": "POST"}',
      RULES),
    H("a route takes any method", MP, "    if method != want:", "    if False:", RULES),
    H("a route matches a prefix", MP, "    want = ROUTES.get(target)",
      '    want = next((m for t, m in ROUTES.items() if target.startswith(t)), None)', RULES),
    H("n (several answers billed) is forwarded", REQ, '    "model": string,\n',
      '    "model": string,\n    "n": integer(1, 128),\n', RULES),
    H("unknown fields are forwarded", MP,
      "extra = sorted(k for k in obj if k not in CHAT_FIELDS)", "extra: list = []", POLICY),
    H("any model is forwarded", MP, 'if not isinstance(model, str) or model not in self.models:',
      "if not isinstance(model, str):", RULES),
    H("a non-string model is looked up", MP,
      'if not isinstance(model, str) or model not in self.models:',
      "if model not in self.models:", RULES),
    H("a stream's usage is not forced on", MP, '            opts["include_usage"] = True\n', "",
      RULES),
    H("every header is forwarded", MP, "if low in FORWARD_HEADERS and low not in seen:",
      "if low not in seen:", RULES),
    H("x-api-key is forwarded", MP, '    "accept", "content-type", "user-agent",',
      '    "accept", "content-type", "user-agent", "x-api-key",', RULES),
    H("a header value is not cut", MP, '" ".join(str(v).split())[:1000]', '" ".join(str(v).split())',
      RULES),
    H("a header value keeps its line breaks", MP, '" ".join(str(v).split())[:1000]', 'str(v)[:1000]',
      RULES),
    H("the body cap's floor and ceiling swapped", MP,
      "return min(MAX_REQUEST_BYTES, max(MIN_REQUEST_BYTES, n))",
      "return max(MIN_REQUEST_BYTES, min(MAX_REQUEST_BYTES, n)) * 2", RULES),
    H("another charset is accepted", MP,
      'if ctype[0].strip().lower() != "application/json" or params not in ("", "charset=utf-8"):',
      'if ctype[0].strip().lower() != "application/json":', POLICY),
    H("NaN is accepted", MP, "parse_constant=_no_constant,", "", POLICY),
    # -- the relay ------------------------------------------------------------------------
    H("the caller's Proxy-Authorization is relayed back as a response header", RL,
      '"proxy-authorization", "te", "trailer",', '"te", "trailer",', RULES),
    H("the service's key is not added", RL, '            out.append(("Authorization", f"Bearer {key}"))\n',
      "            pass\n", HTTP),
    H("the caller's content type is forwarded as sent", RL,
      '               if k.lower() != "content-type"]', "               ]", HTTP),
]

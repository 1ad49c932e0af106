"""Group ``network``: a sandbox's network (sandbox/net/): its sockets (sockets.py), the
egress rules and deny set (egress_policy.py), the egress proxy (egress_proxy.py), the service
port's gate (service_gate.py), the relay, strict heads, each sandbox's lookups, the host's own
addresses, the refusal log."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="network")
EP = "hermes_service/sandbox/net/egress_policy.py"
EX = "hermes_service/sandbox/net/egress_proxy.py"
SG = "hermes_service/sandbox/net/service_gate.py"
SN = "hermes_service/sandbox/net/sockets.py"
NETDIR = "hermes_service/sandbox/net/"
UNIT = "tests/unit/sandbox/net/"
RULES = "tests/unit/sandbox/net/test_network_rules.py"
POLICY = ["tests/unit/sandbox/net/test_egress_policy.py", RULES]
PROXY = ["tests/unit/sandbox/net/test_egress_proxy.py", RULES]
GATE = ["tests/unit/sandbox/net/test_service_gate.py", RULES]
NET = ["tests/unit/sandbox/net/test_sockets.py"]

MUTANTS = [
    # -- the deny set --------------------------------------------------------------------
    H("10/8 reachable", EP, '"0.0.0.0/8", "10.0.0.0/8", ', '"0.0.0.0/8", ', POLICY),
    H("carrier-grade NAT reachable", EP, '"100.64.0.0/10", ', "", POLICY),
    H("172.16/12 reachable", EP, '"172.16.0.0/12", ', "", POLICY),
    H("192.168/16 reachable", EP, '"192.168.0.0/16", ', "", POLICY),
    H("unique local IPv6 reachable", EP, '"fc00::/7", ', "", POLICY),
    H("loopback reachable", EP,
      "if addr in own or addr.is_multicast or addr.is_loopback or addr.is_link_local:",
      "if addr in own or addr.is_multicast or addr.is_link_local:", POLICY),
    H("link-local (the metadata endpoint) reachable", EP,
      "if addr in own or addr.is_multicast or addr.is_loopback or addr.is_link_local:",
      "if addr in own or addr.is_multicast or addr.is_loopback:", POLICY),
    H("the host's own addresses reachable", EP,
      "if addr in own or addr.is_multicast or addr.is_loopback or addr.is_link_local:",
      "if addr.is_multicast or addr.is_loopback or addr.is_link_local:", POLICY),
    H("an IPv4-mapped IPv6 address is not unwrapped", EP,
      "    if addr.ipv4_mapped is not None:\n        return addr.ipv4_mapped\n", "", POLICY),
    H("6to4 is not unwrapped", EP,
      "    if addr.sixtofour is not None:\n        return addr.sixtofour\n", "", POLICY),
    H("NAT64 is not unwrapped", EP,
      'if addr in ipaddress.ip_network("64:ff9b::/96") or addr in ipaddress.ip_network("::/96"):',
      'if addr in ipaddress.ip_network("::/96"):', POLICY),
    H("an embedded IPv4 address is not checked", EP,
      "    return inner is not None and denied_address(inner, own)",
      "    return False", POLICY),
    # -- resolve once, every answer checked ------------------------------------------------
    H("one denied address among several is skipped, not refused", EP,
      "        if denied_address(addr, own):\n            return [], \"denied_address\"",
      "        if denied_address(addr, own):\n            continue", POLICY),
    H("an address with a zone is taken as is", EP,
      '            return [], "denied_address"\n        if denied_address',
      '            continue\n        if denied_address', POLICY),
    H("the proxy dials the name, not the checked addresses", EX,
      "            await asyncio.wait_for(loop.sock_connect(sock, sockaddr), CONNECT_TIMEOUT)",
      "            await asyncio.wait_for(loop.sock_connect(sock, (\"127.0.0.1\", sockaddr[1])), "
      "CONNECT_TIMEOUT)",
      PROXY),
    H("the proxy skips the resolver's verdict", EX,
      "        addresses, out.refused = await resolver(",
      "        addresses, _ = await resolver(", PROXY),
    H("the proxy skips the policy", EX, "        out.refused = policy.decide(req.host, req.port)",
      "        out.refused = None", PROXY),
    # -- allow / deny rules ----------------------------------------------------------------
    H("deny loses to allow", EP,
      '        if any(r.matches(norm, port) for r in self.deny):\n            return "denied"\n', "",
      POLICY),
    H("a wildcard matches its bare suffix's look-alikes", EP,
      'return not is_ip(host) and host.endswith(self.host[1:])',
      'return not is_ip(host) and host.endswith(self.host[2:])', POLICY),
    H("a rule's port is ignored", EP,
      "        if self.port is not None and self.port != port:\n            return False\n", "",
      POLICY),
    H("a host is compared without normalizing", EP, "        norm = normalize_host(host)\n        if norm is None or not 0 < port < 65536:",
      "        norm = host\n        if norm is None or not 0 < port < 65536:", POLICY),
    H("a wildcard matches IP literals", EP, 'return not is_ip(host) and host.endswith(self.host[1:])',
      'return host.endswith(self.host[1:])', POLICY),
    # -- the service gate ----------------------------------------------------------------
    H("a route prefix not ending in / owns what is below it", SG,
      "        if target == prefix:\n            return True",
      "        if target.startswith(prefix):\n            return True", GATE),
    H("a dot segment passes the route check", SG,
      'if not target.startswith("/") or any(seg in (".", "..") for seg in target.split("/")):',
      'if not target.startswith("/"):', GATE),
    H("an encoded slash passes the route check", SG, '("%2e", "%2f", "%5c", "\\\\")',
      '("%2e", "%5c", "\\\\")', GATE),
    H("a chunked request is passed on", SG,
      '    if h.values("transfer-encoding"):\n        return "411 Length Required", "length_required"\n',
      "", GATE),
    H("two Content-Lengths are accepted", SG, "    if len(lengths) > 1 or length is None:",
      "    if length is None:", GATE),
    H("the request is not closed after one answer", SG,
      '*fields, "Connection: close"]', "*fields]", GATE),
    H("a pipelined Connection: keep-alive is passed on", SG,
      '_DROP = ("connection", "keep-alive", ', '_DROP = (', GATE),
    H("the pace never waits", SG, "            if self.tokens >= 1:", "            if True:", GATE),
    H("the pace's burst is unbounded", SG,
      "self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)",
      "self.tokens = self.tokens + (now - self.at) * self.rate", GATE),
    # -- per-sandbox caps ----------------------------------------------------------------
    H("one connection over the cap", SN, "while att.open[name] >= getattr(self.caps, name):",
      "while att.open[name] > getattr(self.caps, name):", NET),
    H("no cap at all", SN, "while att.open[name] >= getattr(self.caps, name):",
      "while False:", NET),
    # -- each sandbox's own lookups ------------------------------------------------------
    H("a sandbox's lookups in flight have no cap", NETDIR + "lookups.py",
      "        if self.busy >= self.cap:", "        if False:", [UNIT + "test_lookups.py"]),
    H("a lookup has no deadline", NETDIR + "lookups.py",
      "return await asyncio.wait_for(asyncio.shield(fut), self.timeout)", "return await fut",
      [UNIT + "test_lookups.py"]),
    H("a timed-out lookup frees its place before its thread does", NETDIR + "lookups.py",
      '        except TimeoutError:\n            return [], "lookup_timeout"',
      '        except TimeoutError:\n            self.busy -= 1\n            return [], '
      '"lookup_timeout"', [UNIT + "test_lookups.py"]),
    H("lookups on the pool every sandbox shares", NETDIR + "lookups.py",
      "run_in_executor(self._pool, resolve, host, port)",
      "run_in_executor(None, resolve, host, port)", [UNIT + "test_lookups.py"]),
    # -- the host's own addresses, now ---------------------------------------------------
    H("the host's addresses are read once", NETDIR + "own_addresses.py",
      "if self._changed() or self._known is None or now - self._at >= self.max_age:",
      "if self._known is None:", [UNIT + "test_own_addresses.py"]),
    # -- numbers and heads -----------------------------------------------------------------
    H("a Unicode digit is read as a number", NETDIR + "http_head.py",
      "if 0 < len(text) <= digits and _DIGITS.fullmatch(text):",
      "if 0 < len(text) <= digits and text.isdigit():", [UNIT + "test_http_head.py"]),
    H("a number's length is unbounded", NETDIR + "http_head.py",
      "if 0 < len(text) <= digits and _DIGITS.fullmatch(text):",
      "if 0 < len(text) and _DIGITS.fullmatch(text):", [UNIT + "test_http_head.py"]),
    H("a field with a control character is taken", NETDIR + "http_head.py",
      "if not sep or not _TOKEN.fullmatch(name) or _CONTROL.search(value):",
      "if not sep or not _TOKEN.fullmatch(name):", [UNIT + "test_http_head.py"]),
    # -- Host: only the checked name ---------------------------------------------------------
    H("the client's Host is forwarded beside the checked one", EX,
      '"connection", "keep-alive", "host",', '"connection", "keep-alive",', PROXY),
    H("a Host naming another host is passed", EX,
      '    if hosts and authority(hosts[0], 80) != dest:\n        return "host_mismatch"\n', "",
      PROXY),
    H("bytes after the body reach the origin", EX,
      "            limit = len(req.upstream) + req.body", "            limit = None", PROXY),
    # -- the relay and the log ----------------------------------------------------------------
    H("the relay passes no end of input on", NETDIR + "relay.py",
      "                dst.shutdown(socket.SHUT_WR)", "                pass",
      [UNIT + "test_relay.py"]),
    H("the relay ignores its byte limit", NETDIR + "relay.py",
      "        while limit is None or moved < limit:", "        while True:",
      [UNIT + "test_relay.py"]),
    H("every refusal is a log line", NETDIR + "refusals.py",
      "if window is not None and now - window.since < self.interval:", "if False:",
      [UNIT + "test_refusals.py"]),
]

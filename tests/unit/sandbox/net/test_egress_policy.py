"""The egress policy (hermes_service/sandbox/net/egress_policy.py; docs/sandbox.md §Network): rules, the
address deny set, resolve-then-check."""
from __future__ import annotations

import ipaddress
import socket

import pytest

from hermes_service.sandbox.net import egress_policy
from hermes_service.sandbox.net.egress_policy import Policy, Rule, denied_address


def ip(text: str):
    return ipaddress.ip_address(text)


@pytest.mark.parametrize("addr", [
    "127.0.0.1", "127.9.9.9", "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1",
    "169.254.169.254", "100.64.0.1", "100.127.255.255", "198.18.0.1", "198.19.255.255",
    "0.0.0.0", "0.1.2.3", "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255",
    "192.0.0.8", "192.88.99.1",
    "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1", "fec0::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
    "64:ff9b::7f00:1", "64:ff9b::a00:1", "2002:7f00:1::1", "2002:a9fe:a9fe::",
    "2001:0:4136:e378:8000:63bf:80ff:fffe",      # Teredo, client 127.0.0.1 (obfuscated)
    "64:ff9b::808:808",                          # NAT64 to a public address: still refused
])
def test_every_special_purpose_address_is_denied(addr):
    assert denied_address(ip(addr))


@pytest.mark.parametrize("addr", ["93.184.215.14", "8.8.8.8", "1.1.1.1", "2606:4700::1111",
                                  "2a00:1450:4001:82a::200e",
                                  # documentation ranges: nothing lives there (the tests' host)
                                  "192.0.2.1", "198.51.100.7", "203.0.113.9", "2001:db8::1"])
def test_public_addresses_pass(addr):
    assert not denied_address(ip(addr))


def test_the_hosts_own_addresses_are_denied_even_when_public():
    own = frozenset({ip("93.184.215.14")})
    assert denied_address(ip("93.184.215.14"), own)
    assert not denied_address(ip("8.8.8.8"), own)


def test_host_addresses_include_loopback():
    own = egress_policy.host_addresses()
    assert ip("127.0.0.1") in own


@pytest.mark.parametrize("entry,host,port,ok", [
    ("example.com", "example.com", 443, True),
    ("example.com", "EXAMPLE.com.", 80, True),
    ("example.com", "www.example.com", 443, False),
    ("*.example.com", "www.example.com", 443, True),
    ("*.example.com", "a.b.example.com", 443, True),
    ("*.example.com", "example.com", 443, False),
    ("*.example.com", "badexample.com", 443, False),
    ("example.com:443", "example.com", 443, True),
    ("example.com:443", "example.com", 80, False),
    ("203.0.113.7", "203.0.113.7", 443, True),
    ("[2001:db8::1]:443", "[2001:db8:0::1]", 443, True),
    ("bücher.example", "xn--bcher-kva.example", 443, True),
])
def test_rules_match_names_wildcards_ports_and_literals(entry, host, port, ok):
    assert Rule.parse(entry).matches(egress_policy.normalize_host(host), port) is ok


@pytest.mark.parametrize("entry", ["", "*", "*.", "exa mple.com", "example.com:0",
                                   "example.com:70000", "example.com:x", "*.1.2.3.4",
                                   "-bad-.com", "a" * 64 + ".com", "[::1"])
def test_bad_entries_are_refused(entry):
    with pytest.raises(ValueError):
        Rule.parse(entry)


def test_deny_wins_and_empty_allow_allows_nothing():
    assert Policy().decide("example.com", 443) == "not_allowed"
    p = Policy.from_lists(["*.example.com"], ["secret.example.com"])
    assert p.decide("api.example.com", 443) is None
    assert p.decide("secret.example.com", 443) == "denied"
    assert p.decide("SECRET.example.com.", 443) == "denied"


def test_an_ip_literal_needs_an_entry_naming_it():
    p = Policy.from_lists(["*.example.com", "93.184.215.14"], [])
    assert p.decide("8.8.8.8", 443) == "ip_literal"
    assert p.decide("[2606:4700::1111]", 443) == "ip_literal"
    assert p.decide("93.184.215.14", 443) is None


@pytest.mark.parametrize("host", ["", "a..b", "exa mple.com", "x" * 300, "bad_char!.com"])
def test_malformed_names_are_bad_requests(host):
    assert Policy.from_lists(["*.com"], []).decide(host, 443) == "bad_request"


def fake_getaddrinfo(answers):
    def getaddrinfo(host, port, type=0, **_):
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port) if ":" not in a else (a, port, 0, 0)) for a in answers[host]]
    return getaddrinfo


def test_resolve_checks_every_address_and_one_bad_answer_taints_the_name(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo({
        "good.example": ["93.184.215.14", "2606:4700::1111"],
        "mixed.example": ["93.184.215.14", "127.0.0.1"],
        "meta.example": ["169.254.169.254"],
        "mapped.example": ["::ffff:10.0.0.1"]}))
    addrs, why = egress_policy.resolve("good.example", 443, own=frozenset())
    assert why is None and [a[1][0] for a in addrs] == ["93.184.215.14", "2606:4700::1111"]
    for name in ("mixed.example", "meta.example", "mapped.example"):
        assert egress_policy.resolve(name, 443, own=frozenset()) == ([], "denied_address")


def test_resolve_names_an_unresolvable_host(monkeypatch):
    def fail(*a, **k):
        raise socket.gaierror("no")
    monkeypatch.setattr(socket, "getaddrinfo", fail)
    assert egress_policy.resolve("nowhere.example", 443) == ([], "unresolvable")

"""Every number and head a sandbox sends, read strictly (hermes_service/sandbox/net/
http_head.py and the two parsers built on it: the egress proxy's and the service gate's):
whatever the bytes, an answer or a refusal, never an exception — property-based
(hypothesis) — and a digit that is not ASCII (superscript, Arabic-Indic, full-width,
mathematical, Devanagari …, each of which ``str.isdigit`` accepts) is never read as a number,
in a port or a length."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_service.sandbox.net import egress_proxy, http_head, service_gate

#: digits str.isdigit() accepts that are not ASCII; int() reads some of them (Arabic-Indic,
#: full-width, mathematical bold, Devanagari) and refuses others (superscripts, circled)
UNICODE_DIGITS = ["\u00b2", "\u00b9", "\u00b3", "\u0663", "\uff13", "\U0001d7d7", "\u0969",
                  "\u09e6", "\u2460", "\u07c2"]
PREFIXES = ("/api/hermes/tools/",)

heads = st.one_of(
    st.binary(max_size=400),
    st.lists(st.sampled_from([
        b"CONNECT", b"GET", b" ", b"http://", b"a.example.com", b":", b"443", b"\r\n",
        b"HTTP/1.1", b"Host", b"Content-Length", b"Transfer-Encoding", b"[", b"]", b"::1",
        b"@", b"/", b"?", b"#", b"\t", b"\x00", b"\n", "²".encode(), "٣".encode(),
        b"\xb2", b"-1", b"99999999999999999999"]), max_size=40).map(b"".join),
).map(lambda b: b + b"\r\n\r\n")


@settings(max_examples=400, deadline=None)
@given(heads)
def test_no_head_makes_a_parser_raise(head):
    parsed = http_head.parse(head)
    assert parsed is None or isinstance(parsed, http_head.Head)
    req = egress_proxy.parse_request(head)
    assert isinstance(req, (str, egress_proxy.Request))
    if isinstance(req, egress_proxy.Request):
        assert 0 < req.port < 65536 and req.host.isascii()
        assert req.body is None or 0 <= req.body < 10 ** egress_proxy.MAX_LENGTH_DIGITS
    gate = service_gate.parse(head, PREFIXES)
    assert isinstance(gate[0], (bytes, str))


@given(st.text(max_size=30))
def test_a_number_is_ascii_digits_or_nothing(text):
    value = http_head.number(text, 5)
    stripped = text.strip(" \t")
    if value is None:
        assert not (stripped.isascii() and stripped.isdigit() and len(stripped) <= 5)
    else:
        assert stripped.isascii() and stripped.isdigit() and value == int(stripped)
        assert value < 10 ** 5


@pytest.mark.parametrize("digit", UNICODE_DIGITS)
def test_a_unicode_digit_is_no_number_anywhere(digit):
    assert digit.isdigit()
    assert http_head.number(digit, 5) is None
    assert http_head.number("44" + digit, 5) is None
    raw = digit.encode("utf-8")
    # the egress proxy: a CONNECT port, an absolute URI's port, a Host port, Content-Length
    assert egress_proxy.parse_request(b"CONNECT a.example.com:" + raw + b" HTTP/1.1\r\n\r\n") \
        == "bad_request"
    assert egress_proxy.parse_request(b"CONNECT a.example.com:44" + raw + b" HTTP/1.1\r\n\r\n") \
        == "bad_request"
    assert egress_proxy.parse_request(b"GET http://a.example.com:" + raw + b"/ HTTP/1.1\r\n\r\n") \
        == "bad_request"
    assert egress_proxy.parse_request(
        b"GET http://a.example.com/ HTTP/1.1\r\nHost: a.example.com:" + raw + b"\r\n\r\n") \
        == "host_mismatch"
    assert egress_proxy.parse_request(
        b"POST http://a.example.com/ HTTP/1.1\r\nContent-Length: " + raw + b"\r\n\r\n") \
        == "bad_request"
    # the service gate: Content-Length
    assert service_gate.parse(b"POST /api/hermes/tools/invoke HTTP/1.1\r\nContent-Length: "
                              + raw + b"\r\n\r\n", PREFIXES) == ("400 Bad Request", "bad_request")


@pytest.mark.parametrize("length", ["1" * 16, "+5", "-0", "5 5", "0x10", "1e3", "5.0", ""])
def test_a_length_that_is_not_a_plain_bounded_number_is_refused(length):
    head = f"POST /api/hermes/tools/invoke HTTP/1.1\r\nContent-Length: {length}\r\n\r\n".encode()
    assert service_gate.parse(head, PREFIXES)[1] == "bad_request"
    proxied = f"POST http://a.example.com/ HTTP/1.1\r\nContent-Length: {length}\r\n\r\n"
    assert egress_proxy.parse_request(proxied.encode()) == "bad_request"


@pytest.mark.parametrize("line", [
    b"GET  / HTTP/1.1", b"GET / HTTP/1.1 ", b"GET / HTTP/2", b"G@T / HTTP/1.1",
    b"GET /\x7f HTTP/1.1", b"GET /\xe9 HTTP/1.1", b"GET / HTTP/1.1\nX: y",
])
def test_a_request_line_out_of_shape_is_refused(line):
    assert http_head.parse(line + b"\r\n\r\n") is None


@pytest.mark.parametrize("field", [
    b"X : y", b" X: y", b"X", b"X: a\rb", b"X: a\x00b", b"\xe9: y", b"X-\x01: y",
])
def test_a_field_out_of_shape_is_refused(field):
    assert http_head.parse(b"GET / HTTP/1.1\r\n" + field + b"\r\n\r\n") is None


def test_a_field_keeps_its_value_without_the_spaces_around_it():
    head = http_head.parse(b"GET / HTTP/1.1\r\nX-A:  one two \t\r\nx-a: three\r\n\r\n")
    assert head is not None and head.values("X-A") == ["one two", "three"]

"""waitress's parser with the framing check (hermes_service/web/framing.py, RFC 9112 §6.1/§6.3):
its quick look for the two framing headers never changes a verdict. Header blocks are
generated (names in any letter case, repeated, folded, with odd spacing) and each is parsed
by :class:`FramingParser` and judged by :func:`framing_problem` on the same lines."""
from __future__ import annotations

import random

import pytest
from waitress.adjustments import Adjustments
from waitress.parser import HTTPRequestParser, ParsingError, get_header_lines

from hermes_service.web.framing import FramingParser, FramingRefused, framing_problem

NAMES = [b"Transfer-Encoding", b"Content-Length", b"Host", b"X-API-Key", b"Accept",
         b"X-Transfer-Encoding-Note", b"Content-Lengths", b"Transfer_Encoding"]
VALUES = [b"chunked", b"chunked, chunked", b"gzip, chunked", b"identity", b"", b"4", b"04",
          b"4, 4", b"-1", b"x", b" 7 ", b"content-length", b"transfer-encoding"]


def any_case(word: bytes, rnd: random.Random) -> bytes:
    return bytes(c ^ 0x20 if chr(c).isalpha() and rnd.random() < 0.5 else c for c in word)


def header_block(rnd: random.Random) -> tuple[bytes, str]:
    version = rnd.choice(["1.1", "1.1", "1.0"])
    path = rnd.choice([b"/health", b"/api/v1/sessions", b"/x/content-length?transfer-encoding"])
    lines = [rnd.choice([b"GET", b"POST"]) + b" " + path + b" HTTP/" + version.encode()]
    for _ in range(rnd.randint(0, 5)):
        line = any_case(rnd.choice(NAMES), rnd) + b":" + rnd.choice([b"", b" ", b"\t"]) + \
            rnd.choice(VALUES)
        if rnd.random() < 0.1:
            line += b"\r\n " + rnd.choice(VALUES)      # an obs-fold continuation line
        lines.append(line)
    return b"\r\n".join(lines) + b"\r\n\r\n", version


@pytest.mark.parametrize("seed", range(4))
def test_the_quick_look_never_changes_the_verdict(seed):
    rnd = random.Random(seed)
    adj = Adjustments()
    for _ in range(2500):
        block, version = header_block(rnd)
        head = block                    # as waitress hands it over: up to CRLF CRLF
        first, _, rest = head.partition(b"\r\n")
        want = framing_problem(version, get_header_lines(rest) if rest else [])
        parser, plain = FramingParser(adj), HTTPRequestParser(adj)
        if want is not None:            # refused by us, in our shape, never by waitress
            parser.parse_header(head)
            assert isinstance(parser.error, FramingRefused) and parser.error.body == want, block
            continue
        try:                            # not refused: parsed exactly as waitress parses it
            plain.parse_header(head)
        except ParsingError:            # waitress refuses the header block itself (400)
            with pytest.raises(ParsingError):
                parser.parse_header(head)
            continue
        parser.parse_header(head)
        assert parser.error is None, block
        assert (parser.headers, parser.path, parser.chunked, parser.content_length) == \
            (plain.headers, plain.path, plain.chunked, plain.content_length), block

"""The worker process that parses and checks a model pass-through request body away from the
service's interpreter (docs/sandbox.md §What the pass-through forwards): a costly body (4 MiB
of ``[],[],…`` parses in ~0.6 s and ~130 MiB) then costs this process's time and memory, at a
lower CPU priority, never the service's GIL.

Run as ``python -E -s -m hermes_service.model_proxy.body_worker MEMORY_BYTES`` by
:mod:`hermes_service.model_proxy.body_check`, which keeps a few and feeds them one request at a
time over stdin/stdout; it lives until its stdin closes. It limits its own address space to
``MEMORY_BYTES`` (``RLIMIT_AS``; a body needing more is refused, ``request_too_complex``) and
lowers its priority (``nice`` +10).

The exchange, each message one JSON header line then raw bytes:

* in: ``{"models": [...], "max_body": N, "context_length": N, "ctype": str | null,
  "length": N}`` + ``length`` body bytes;
* out: ``{"ok": true, "stream", "usage_asked", "prompt_estimate", "max_output",
  "length"}`` + the body to send, or ``{"ok": false, "status", "code", "message",
  "etype"}``.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import BinaryIO

from .policy import Policy, Refusal


def answer(header: dict, body: bytes) -> tuple[dict, bytes]:
    """The reply to one request (``header``, ``body``): :meth:`Policy.prepare_chat`'s."""
    policy = Policy(frozenset(header["models"]), int(header["max_body"]))
    try:
        p = policy.prepare_chat(body, header.get("ctype"))
    except Refusal as r:
        return {"ok": False, "status": r.status, "code": r.code, "message": r.message,
                "etype": r.etype}, b""
    except MemoryError:
        return {"ok": False, "status": 400, "code": "request_too_complex",
                "message": "the body needs more memory to check than the pass-through gives "
                "one request", "etype": "invalid_request_error"}, b""
    return {"ok": True, "stream": p.stream, "usage_asked": p.usage_asked,
            "prompt_estimate": p.prompt_estimate, "max_output": p.max_output,
            "length": len(p.body)}, p.body


def serve(rin: BinaryIO, wout: BinaryIO) -> None:
    """Answer requests from ``rin`` on ``wout`` until ``rin`` ends."""
    while True:
        line = rin.readline()
        if not line:
            return
        header = json.loads(line)
        body = rin.read(int(header["length"]))
        reply, out = answer(header, body)
        del body
        wout.write(json.dumps(reply).encode() + b"\n" + out)
        wout.flush()


def main(argv: list[str]) -> None:
    memory = int(argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.nice(10)
    serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main(sys.argv)

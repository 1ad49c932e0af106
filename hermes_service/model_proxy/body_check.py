"""Checking a request body at a bounded cost to the service (docs/sandbox.md §What the
pass-through forwards, "What a body may cost"): what a user's agent sends is parsed and
checked (:meth:`~hermes_service.model_proxy.policy.Policy.prepare_chat`) either here, when it is
small and holds few JSON values, or in a worker process, never holding the service's GIL for
longer than a small body takes; and each user parses at most its share per second.

* **Inline** — a body of at most :data:`~.limits.INLINE_BYTES` whose JSON values
  (:func:`~hermes_service.json_cost.token_bound`: four C-speed counts) are at most
  :data:`~.limits.INLINE_VALUES`: at most ~2 ms of the GIL (a Hermes request of 56 KB holds
  ~1 800 and is checked in ~1 ms).
* **Out of process** — anything else goes to one of :data:`~.limits.PARSES` worker processes
  (:mod:`hermes_service.model_proxy.body_worker`: address space capped, ``nice`` +10), one at a
  time per user; a body not checked within :data:`~.limits.PARSE_SECONDS`, or needing more
  memory than the worker has, is refused 400 ``request_too_complex`` (the worker killed and
  replaced). No worker free within :data:`~.limits.PARSE_WAIT_SECONDS`: 503
  ``server_overloaded``.
* **Per user** — a token bucket of :data:`~.limits.PARSE_BYTES_PER_SECOND` bytes a second,
  holding at least two bodies of the cap (:func:`parse_burst`); an inline body is charged
  :data:`~.limits.INLINE_VALUE_BYTES` per value when that is more than its size (many small
  values cost the GIL more than their bytes say). Past it: 429 ``too_many_requests`` with
  ``Retry-After``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..json_cost import token_bound
from . import limits
from .policy import Policy, Prepared, Refusal

log = logging.getLogger("hermes_service.model_proxy")

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def parse_burst(max_body: int) -> int:
    """Bytes a user's bucket holds: :data:`~.limits.PARSE_BURST_BYTES`, at least two bodies
    of ``max_body`` (the body cap)."""
    return max(limits.PARSE_BURST_BYTES, 2 * max_body)


def worker_memory(max_body: int) -> int:
    """The address space a worker may use: :data:`~.limits.WORKER_BASE_BYTES` plus
    :data:`~.limits.WORKER_BYTES_PER_BODY_BYTE` per byte of the body cap."""
    return limits.WORKER_BASE_BYTES + limits.WORKER_BYTES_PER_BODY_BYTE * max_body


class WorkerFailed(Exception):
    """A worker did not answer (timed out, died, its pipe broke)."""


class Worker:
    """One ``model_body_worker`` process, answering one request at a time."""

    def __init__(self, memory: int):
        self.memory = memory
        self.proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "-m", "hermes_service.model_proxy.body_worker",
             str(memory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=_PACKAGE_ROOT, close_fds=True, start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self._buf = b""

    def ask(self, header: dict, body: bytes, deadline: float) -> tuple[dict, bytes]:
        """Send one request and read its reply by ``deadline`` (``time.monotonic()``);
        raises :class:`WorkerFailed`."""
        self._write(json.dumps({**header, "length": len(body)}).encode() + b"\n" + body,
                    deadline)
        while b"\n" not in self._buf:
            self._read(deadline)
        line, _, self._buf = self._buf.partition(b"\n")
        reply = json.loads(line)
        n = int(reply.get("length") or 0)
        while len(self._buf) < n:
            self._read(deadline)
        out, self._buf = self._buf[:n], self._buf[n:]
        return reply, out

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerFailed("timed out")
        poller = select.poll()
        poller.register(fd, event | select.POLLERR | select.POLLHUP)
        if not poller.poll(left * 1000):
            raise WorkerFailed("timed out")

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self._in, select.POLLOUT, deadline)
            try:
                sent = os.write(self._in, view[:1 << 20])
            except BlockingIOError:
                continue
            except OSError as exc:
                raise WorkerFailed(f"its pipe broke ({exc})") from None
            view = view[sent:]

    def _read(self, deadline: float) -> None:
        self._wait(self._out, select.POLLIN, deadline)
        try:
            chunk = os.read(self._out, 1 << 20)
        except BlockingIOError:
            return
        if not chunk:
            raise WorkerFailed("it ended")
        self._buf += chunk

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("model body worker %s did not end", self.proc.pid)


class BodyChecker:
    """Checks request bodies for the pass-through (module doc); thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._busy_users: set[str] = set()
        self._idle: list[Worker] = []
        self._buckets: dict[str, tuple[float, float]] = {}    # user -> (level, at)
        self._closed = False

    # -- the per-user budget ----------------------------------------------------------------
    def charge(self, user: str, cost: int, capacity: int) -> None:
        """Take ``cost`` bytes from ``user``'s bucket (refilled at
        :data:`~.limits.PARSE_BYTES_PER_SECOND`, holding ``capacity``); raises
        :class:`Refusal` 429 when it holds less."""
        rate = limits.PARSE_BYTES_PER_SECOND
        now = time.monotonic()
        with self._cond:
            level, at = self._buckets.get(user, (capacity, now))
            level = min(capacity, level + (now - at) * rate)
            if level < cost:
                self._buckets[user] = (level, now)
                wait = math.ceil((min(cost, capacity) - level) / rate)
                raise Refusal(429, "too_many_requests", f"this user's model request bodies are "
                              f"over {rate // (1024 * 1024)} MiB a second to check; retry",
                              etype="rate_limit_error", headers={"Retry-After": str(max(1, wait))})
            if level - cost >= capacity and user in self._buckets:
                del self._buckets[user]                       # full again: forget it
            else:
                self._buckets[user] = (level - cost, now)

    # -- checking -------------------------------------------------------------------------
    def admit(self, policy: Policy, user: str, length: int) -> None:
        """Charge a body of ``length`` bytes to ``user``'s bucket before it is read; raises
        :class:`Refusal` 429 (the body is then drained, never parsed)."""
        if length:
            self.charge(user, length, parse_burst(policy.max_body))

    def prepare(self, policy: Policy, user: str, body: bytes, ctype: str | None) -> Prepared:
        """``policy.prepare_chat(body, ctype)`` at a bounded cost (module doc), for a body
        :meth:`admit` charged. Raises :class:`Refusal`: the policy's, and 400
        ``request_too_complex``, 429 ``too_many_requests`` (an inline body's values past its
        bytes), 503 ``server_overloaded``."""
        values = token_bound(body) if len(body) <= limits.INLINE_BYTES else None
        if values is not None and values <= limits.INLINE_VALUES:
            extra = values * limits.INLINE_VALUE_BYTES - len(body)
            if extra > 0:
                self.charge(user, extra, parse_burst(policy.max_body))
            return policy.prepare_chat(body, ctype)
        worker = self._take(user, worker_memory(policy.max_body))
        keep = False
        try:
            reply, out = worker.ask({"models": sorted(policy.models),
                                     "max_body": policy.max_body, "ctype": ctype}, body,
                                    time.monotonic() + limits.PARSE_SECONDS)
            keep = True
        except WorkerFailed as exc:
            log.info("model request body of user=%s refused: its check %s", user, exc)
            raise Refusal(400, "request_too_complex", f"the body could not be checked within "
                          f"{limits.PARSE_SECONDS:g} s and "
                          f"{worker.memory // (1024 * 1024)} MiB (its JSON holds too many "
                          "values)") from None
        finally:
            self._give(user, worker if keep else None, worker)
        if not reply.get("ok"):
            raise Refusal(int(reply["status"]), str(reply["code"]), str(reply["message"]),
                          etype=str(reply.get("etype") or "invalid_request_error"))
        return Prepared(out, bool(reply["stream"]), bool(reply["usage_asked"]),
                        int(reply["prompt_estimate"]), reply.get("max_output"))

    def _take(self, user: str, memory: int) -> Worker:
        deadline = time.monotonic() + limits.PARSE_WAIT_SECONDS
        with self._cond:
            while self._busy >= limits.PARSES or user in self._busy_users:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise Refusal(503, "server_overloaded", "the pass-through is checking too "
                                  "many request bodies now; retry", etype="server_error",
                                  headers={"Retry-After": "1"})
                self._cond.wait(left)
            self._busy += 1
            self._busy_users.add(user)
            worker = self._idle.pop() if self._idle else None
        if worker is not None and (worker.memory != memory or worker.proc.poll() is not None):
            worker.kill()
            worker = None
        if worker is None:
            try:
                worker = Worker(memory)
            except OSError as exc:
                self._give(user, None, None)
                log.warning("model body worker not started: %s", exc)
                raise Refusal(503, "server_overloaded", "the pass-through cannot check "
                              "request bodies now; retry", etype="server_error",
                              headers={"Retry-After": "1"}) from None
        return worker

    def _give(self, user: str, keep: Worker | None, used: Worker | None) -> None:
        if used is not None and keep is None:
            used.kill()
        with self._cond:
            self._busy -= 1
            self._busy_users.discard(user)
            if keep is not None:
                if self._closed:
                    keep.kill()
                else:
                    self._idle.append(keep)
            self._cond.notify_all()

    def close(self) -> None:
        """End every idle worker (busy ones end when their request does)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            w.kill()

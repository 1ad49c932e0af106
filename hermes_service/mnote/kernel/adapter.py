"""The page tools against mnote's kernel (``mnote.page_store.kind: command | http``;
docs/mnote-tools.md §The kernel adapter).

:class:`KernelBackend` is the :class:`~.tools.ToolExecutor`'s backend for a kernel: the
executor has already checked the envelope, the tool's schema and the run's capability scope
(and the tool gateway the run token and the run's page); the backend sends the call as the
contract's §2 envelope through a transport (:class:`~.kernel_http.HttpKernel`,
:class:`~.kernel_command.CommandKernel`) and returns what the kernel answered:

* a success: its ``result``, ``audit.effect`` and ``audit.commandId``;
* a kernel ``ok: false``: its ``error.code`` and ``error.message``, unchanged (permissions,
  conflicts, idempotency are the kernel's);
* no usable answer (:class:`~.kernel_wire.KernelFailure`): ``mnote_tool_kernel_unavailable``
  with the reason's message, a metric and a warning line with the trace and run ids — never
  the kernel's body.

A transport failure (not reached, reset, closed before answering, a gateway's 502/503/504,
a command that could not start or was killed by a signal) is retried, up to
:data:`MAX_RETRIES` times with the same envelope (so the same ``idempotencyKey``), within
the call's one budget ``mnote.page_store.timeout_seconds``: no call outlasts it. At most
:data:`MAX_CONCURRENT` calls are in flight at once (connections, command processes); one that
finds no slot within its budget is the failure ``busy``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .. import metrics
from ..page_store import CommandResult
from .wire import KernelFailure, KernelToolError, encode, read_answer, request_envelope, unavailable

log = logging.getLogger("hermes_service.mnote.kernel")

#: further attempts after a transport failure
MAX_RETRIES = 2
#: pause before retry n (seconds; cut to the time left)
BACKOFF_SECONDS = (0.05, 0.2)
#: kernel calls in flight at once (a run token's holder can post tool calls in parallel)
MAX_CONCURRENT = 8


class Transport(Protocol):
    transport: str

    def exchange(self, body: bytes, deadline: float) -> tuple[int, bytes]: ...

    def close(self) -> None: ...


def read_exchange(transport: Transport, status: int, data: bytes, sent: dict):
    """The :class:`~.kernel_wire.KernelAnswer` of an exchange: a command that exited 0 or an
    HTTP 2xx must hold a valid envelope for ``sent``; an HTTP 4xx or 500 may (a kernel may
    send its failures with an error status), else it is the failure ``unauthorized`` (401,
    403: the credential) or ``http_status``."""
    if transport.transport != "http" or 200 <= status < 300:
        return read_answer(data, sent)
    if 400 <= status <= 500:
        try:
            return read_answer(data, sent)
        except KernelFailure:
            pass
    if status in (401, 403):
        raise KernelFailure("unauthorized", f"HTTP {status} without an envelope: check the "
                                            "credential (mnote.page_store.credential_env)")
    raise KernelFailure("http_status", f"HTTP {status} without an envelope")


def redact(text: str, credential_env: str | None) -> str:
    """``text`` with the credential's value (if any) replaced by ``***``."""
    value = os.environ.get(credential_env) if credential_env else None
    return text.replace(value, "***") if value else text


class KernelBackend:
    """Sends validated tool calls to one kernel (see the module doc)."""

    def __init__(self, transport: Transport, timeout_seconds: float, *,
                 max_retries: int = MAX_RETRIES, sleep: Callable[[float], None] = time.sleep):
        self.transport = transport
        self.timeout_seconds = float(timeout_seconds)
        self.max_retries = max_retries
        self._sleep = sleep
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)

    def close(self) -> None:
        self.transport.close()

    def _redact(self, text: str) -> str:
        return redact(text, getattr(self.transport, "credential_env", None))

    def run(self, spec, env: dict, args: dict) -> CommandResult:
        """One tool call (``env``: the executor's validated envelope, ``args`` the tool
        fields). Returns the kernel's success; raises :class:`KernelToolError` with the
        kernel's code, or ``mnote_tool_kernel_unavailable``."""
        sent = request_envelope(spec.name, env, args, spec.writes)
        started = time.monotonic()
        try:
            answer = self.call(sent, started + self.timeout_seconds)
        except KernelFailure as failure:
            metrics.kernel_call(self.transport.transport, failure.reason,
                                time.monotonic() - started)
            log.warning("mnote kernel (%s) gave %s no usable answer: %s: %s",
                        self.transport.transport, spec.name, failure.reason,
                        self._redact(failure.detail),
                        extra={"trace_id": sent["traceId"], "run_id": sent["runId"]})
            raise unavailable(failure.reason, sent) from None
        metrics.kernel_call(self.transport.transport, "ok", time.monotonic() - started)
        if not answer.ok:
            raise KernelToolError(answer.code, answer.message)
        return CommandResult(answer.result, answer.effect, answer.command_id)

    def call(self, sent: dict, deadline: float):
        """``sent`` to the kernel, retried on transport failures until ``deadline``; the
        checked :class:`~.kernel_wire.KernelAnswer`. Raises KernelFailure (the last one)."""
        if not self._slots.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise KernelFailure("busy", f"{MAX_CONCURRENT} kernel calls in flight for the whole "
                                        "budget")
        try:
            return self._attempts(sent, deadline)
        finally:
            self._slots.release()

    def _attempts(self, sent: dict, deadline: float):
        body = encode(sent)
        for attempt in range(self.max_retries + 1):
            try:
                status, data = self.transport.exchange(body, deadline)
                return read_exchange(self.transport, status, data, sent)
            except KernelFailure as failure:
                left = deadline - time.monotonic()
                if not failure.retryable or attempt == self.max_retries or left <= 0:
                    # whatever else that kernel left on a kept connection is not read later
                    self.transport.close()
                    raise
                pause = min(BACKOFF_SECONDS[min(attempt, len(BACKOFF_SECONDS) - 1)], left)
                metrics.kernel_retry(self.transport.transport)
                log.info("mnote kernel (%s): %s (%s), attempt %d of %d with the same envelope",
                         self.transport.transport, failure.reason,
                         self._redact(failure.detail), attempt + 2, self.max_retries + 1,
                         extra={"trace_id": sent["traceId"], "run_id": sent["runId"]})
                self._sleep(pause)
        raise AssertionError("unreachable")


def backend_for(page_store) -> KernelBackend | None:
    """The backend of ``mnote.page_store`` (:class:`~.settings.PageStoreSettings`); None for
    the embedded store."""
    transport: Transport
    if page_store.kind == "http":
        from .over_http import HttpKernel
        transport = HttpKernel(page_store.url, credential_env=page_store.credential_env,
                               ca_file=page_store.ca_file)
    elif page_store.kind == "command":
        from .command import CommandKernel
        transport = CommandKernel(page_store.command, credential_env=page_store.credential_env)
    else:
        return None
    return KernelBackend(transport, page_store.timeout_seconds)

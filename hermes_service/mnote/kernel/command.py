"""The kernel as a command: ``mnote.page_store.command`` (an argv, never a shell) run once per
call, the §2 envelope on its standard input, the §3 answer on its standard output
(docs/mnote-tools.md §The kernel adapter).

:class:`CommandKernel` starts the command in a process group of its own, in the service's
working directory, with a clean environment (:func:`command_env`: ``PATH``, ``HOME``,
``LANG``/``LC_ALL`` and, when ``mnote.page_store.credential_env`` names one, that variable —
never the service's own secrets, never an argument), writes the envelope and closes standard
input, and reads at most :data:`~.kernel_wire.MAX_ANSWER_BYTES` of standard output and the
last :data:`STDERR_TAIL` bytes of standard error, all against the call's deadline. The whole
process group is killed when the deadline passes, when the output grows too large, and after
the command exits (nothing it started outlives the call).
"""
from __future__ import annotations

import errno
import os
import selectors
import signal
import subprocess
import time

from .wire import MAX_ANSWER_BYTES, KernelFailure

#: bytes of standard error kept (the end of it), for the log of a failing command
STDERR_TAIL = 2048
#: how long the pipes may stay open after the command exited (a child of it holding them)
EXIT_GRACE_SECONDS = 0.2
_FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin"
#: start failures that another attempt cannot fix (a configuration problem)
_PERMANENT = frozenset({errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.EISDIR})


def command_env(credential_env: str | None) -> dict:
    """The command's whole environment: the service's ``PATH`` and ``HOME``, a UTF-8 locale,
    and the credential variable (by its own name) when one is configured."""
    env = {"PATH": os.environ.get("PATH") or _FALLBACK_PATH, "HOME": os.environ.get("HOME", "/"),
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    if credential_env and os.environ.get(credential_env):
        env[credential_env] = os.environ[credential_env]
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class CommandKernel:
    """``exchange(body, deadline) -> (exit status, standard output)`` of one command."""
    transport = "command"

    def __init__(self, argv: list[str] | tuple[str, ...], *, credential_env: str | None = None):
        if not argv:
            raise ValueError("the kernel command needs an argv")
        self.argv = list(argv)
        self.credential_env = credential_env

    def close(self) -> None:
        """Nothing is kept between calls."""

    def exchange(self, body: bytes, deadline: float) -> tuple[int, bytes]:
        """Run the command once. KernelFailure: ``unreachable`` (it could not be started;
        retryable unless the program is missing or not executable), ``timeout``,
        ``too_large``, ``exit_status`` (retryable when a signal it was not sent by this
        service ended it). Returns (0, standard output) otherwise."""
        if deadline - time.monotonic() <= 0:
            raise KernelFailure("timeout", "no time left for another attempt")
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=command_env(self.credential_env),
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            raise KernelFailure("unreachable", f"cannot start the command "
                                               f"({exc.strerror or type(exc).__name__})",
                                retryable=exc.errno not in _PERMANENT) from None
        try:
            out, err = self._talk(proc, body, deadline)
        except OSError as exc:          # e.g. no file descriptor left for the pidfd
            raise KernelFailure("unreachable", f"cannot talk to the command "
                                               f"({exc.strerror or type(exc).__name__})",
                                retryable=True) from None
        finally:
            _kill_group(proc)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        status = proc.returncode
        if status != 0:
            tail = err[-STDERR_TAIL:].decode("utf-8", "replace")
            if status < 0:
                raise KernelFailure("exit_status", f"ended by signal {-status}; stderr {tail!r}",
                                    retryable=True)
            raise KernelFailure("exit_status", f"exit status {status}; stderr {tail!r}")
        return status, out

    @staticmethod
    def _talk(proc: subprocess.Popen, body: bytes, deadline: float) -> tuple[bytes, bytes]:
        """Write ``body`` and read both outputs until they close and the command has exited
        (or it has exited and :data:`EXIT_GRACE_SECONDS` passed: something it started holds
        the pipes). Its exit is watched through a pidfd, which leaves it unreaped: its process
        group id stays its own until the caller has killed the group. KernelFailure
        ``timeout`` / ``too_large``."""
        stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None   # pipes
        sel = selectors.DefaultSelector()
        out, err, pending = bytearray(), bytearray(), memoryview(body)
        pidfd = os.pidfd_open(proc.pid)
        try:
            for pipe in (stdin, stdout, stderr):
                os.set_blocking(pipe.fileno(), False)
            sel.register(stdin, selectors.EVENT_WRITE, "in")
            sel.register(stdout, selectors.EVENT_READ, "out")
            sel.register(stderr, selectors.EVENT_READ, "err")
            sel.register(pidfd, selectors.EVENT_READ, "exit")
            exited_at = None
            while True:
                now = time.monotonic()
                reading = sum(1 for k in sel.get_map().values() if k.data in ("out", "err"))
                if exited_at is not None and (not reading or now - exited_at > EXIT_GRACE_SECONDS):
                    return bytes(out), bytes(err)
                if now >= deadline:
                    raise KernelFailure("timeout", f"no complete answer by the deadline "
                                                   f"({len(out)} bytes of output so far)")
                wait = deadline - now
                if exited_at is not None:
                    wait = min(wait, exited_at + EXIT_GRACE_SECONDS - now)
                for key, _ in sel.select(max(wait, 0)):
                    if key.data == "exit":
                        sel.unregister(pidfd)
                        exited_at = time.monotonic()
                    elif key.data == "in":
                        pending = CommandKernel._feed(sel, stdin, pending)
                    else:
                        CommandKernel._take(sel, key, out, err)
        finally:
            sel.close()
            os.close(pidfd)

    @staticmethod
    def _feed(sel: selectors.BaseSelector, stdin, pending: memoryview) -> memoryview:
        """Write what the command's ``stdin`` takes of ``pending``; what is left (``stdin``
        closed and unwatched once all is written, or once the command stopped reading)."""
        try:
            n = os.write(stdin.fileno(), pending[:65536])
        except BrokenPipeError:
            n = len(pending)     # it stopped reading: its answer tells
        pending = pending[n:]
        if not pending:
            sel.unregister(stdin)
            stdin.close()
        return pending

    @staticmethod
    def _take(sel: selectors.BaseSelector, key: selectors.SelectorKey, out: bytearray,
              err: bytearray) -> None:
        """Read what ``key``'s pipe holds into ``out`` (standard output; KernelFailure
        ``too_large`` past :data:`MAX_ANSWER_BYTES`) or ``err`` (its last
        :data:`STDERR_TAIL` bytes); a closed pipe is unwatched."""
        chunk = os.read(key.fd, 65536)
        if not chunk:
            sel.unregister(key.fileobj)
        elif key.data == "out":
            out += chunk
            if len(out) > MAX_ANSWER_BYTES:
                raise KernelFailure("too_large", f"more than {MAX_ANSWER_BYTES}"
                                                 " bytes on standard output")
        else:
            err += chunk
            del err[:-STDERR_TAIL]

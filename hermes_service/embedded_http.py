"""The service's embedded HTTP servers (the model pass-through, the scripted model): a
``ThreadingHTTPServer`` with one thread per connection, whose open connections are known
(:class:`OpenConnections`), so that stopping it (:func:`stop_server`) ends every one — an idle
keep-alive connection, or an exchange still in progress. Standard library only."""
from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer


class OpenConnections:
    """The client connections a server holds open now (its handlers' ``setup``/``finish``
    call :meth:`track`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()

    def track(self, conn: socket.socket, add: bool) -> None:
        """A connection opened (``add``) or closed."""
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def __len__(self) -> int:
        with self._lock:
            return len(self._conns)

    def cut(self) -> None:
        """Shut every open connection down (both directions): its handler's reads and writes
        fail at once."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def stop_server(server: ThreadingHTTPServer, thread: threading.Thread | None,
                conns: OpenConnections, timeout: float = 5.0) -> None:
    """Stop ``server``: no new connection, its socket closed, every open connection cut, and
    its serving ``thread`` joined (at most ``timeout`` seconds)."""
    server.shutdown()
    server.server_close()
    conns.cut()
    if thread is not None:
        thread.join(timeout)

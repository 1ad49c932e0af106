"""The sandbox's forwarder: its loopback ports to the Unix sockets the service bound into it
(``hermes.sandbox.network: isolated``; docs/sandbox.md §Network). Standard library only: it
runs inside the Hermes process, started by ``sitecustomize`` before Hermes's own code.

``HERMES_SERVICE_FORWARD`` (taken out of the environment, so nothing Hermes starts sees it)
lists ``<port>=<socket path>`` pairs separated by spaces. :func:`start` binds each port on
``127.0.0.1`` at once — before Hermes runs, so nothing else in the sandbox can take a port
first and Hermes's first request finds it listening — and one daemon thread relays every
connection to its socket with non-blocking sockets and :mod:`selectors`: one thread however
many connections, at most :data:`MAX_PER_PORT` open per port (past it the port stops
accepting until one ends: the rest wait in the backlog). Being inside Hermes, the forwarder
lives and dies with it, and no tool can end it without ending Hermes.
"""
import os
import selectors
import socket
import threading

ENV = "HERMES_SERVICE_FORWARD"
#: "1": the Hermes process itself sends nothing through the egress proxy (no destination
#: is allowed); only the processes it starts get the proxy variables.
CHILDREN_ONLY_ENV = "HERMES_SERVICE_PROXY_CHILDREN_ONLY"
NO_PROXY_NAMES = ("NO_PROXY", "no_proxy")
MAX_PER_PORT = 64
CHUNK = 65536


class _Pair:
    """One relayed connection: the sandbox-side TCP socket and the service-side Unix socket,
    the bytes waiting to be written to each, and which sides have ended their input."""

    def __init__(self, port, tcp, unix):
        self.port, self.tcp, self.unix = port, tcp, unix
        self.pending = {tcp: b"", unix: b""}
        self.eof = set()
        self.closed = False

    def other(self, sock):
        return self.unix if sock is self.tcp else self.tcp


class Forwarder:
    def __init__(self, routes):
        self.sel = selectors.DefaultSelector()
        self.open = {}
        self.listeners = {}
        for port, path in routes:
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(("127.0.0.1", port))
            ls.listen(128)
            ls.setblocking(False)
            self.listeners[port] = (ls, path)
            self.open[port] = 0
            self.sel.register(ls, selectors.EVENT_READ, port)

    def run(self):
        while True:
            for key, mask in self.sel.select():
                if not isinstance(key.data, _Pair):
                    self._accept(key.data)
                    continue
                pair, sock = key.data, key.fileobj
                if mask & selectors.EVENT_WRITE:
                    self._flush(pair, sock)
                if mask & selectors.EVENT_READ and not pair.closed:
                    self._read(pair, sock)

    def _accept(self, port):
        ls, path = self.listeners[port]
        try:
            tcp, _ = ls.accept()
        except OSError:
            return
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.setblocking(False)       # a full backlog at the service refuses, never blocks
        try:
            unix.connect(path)
        except OSError:
            tcp.close()
            unix.close()
            return
        tcp.setblocking(False)
        # small pieces (a streamed answer's chunks) go at once: no Nagle delay against the
        # reader's delayed ACK
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(port, tcp, unix)
        self.open[port] += 1
        if self.open[port] >= MAX_PER_PORT:
            self.sel.unregister(ls)
        self.sel.register(tcp, selectors.EVENT_READ, pair)
        self.sel.register(unix, selectors.EVENT_READ, pair)

    def _read(self, pair, sock):
        try:
            data = sock.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        dst = pair.other(sock)
        if data:
            pair.pending[dst] = data
            self._flush(pair, dst)
            return
        pair.eof.add(sock)
        if sock is pair.tcp:
            try:
                dst.shutdown(socket.SHUT_WR)      # the sandbox is done sending
            except OSError:
                pass
        self._watch(pair)

    def _flush(self, pair, dst):
        try:
            sent = dst.send(pair.pending[dst])
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(pair)
            return
        pair.pending[dst] = pair.pending[dst][sent:]
        self._watch(pair)

    def _watch(self, pair):
        """Read a side only while what it sent has been written on; write while a side has
        bytes waiting. Over once the service's side has ended and its bytes are delivered."""
        if pair.closed:
            return
        if pair.unix in pair.eof and not pair.pending[pair.tcp]:
            self._close(pair)
            return
        for sock in (pair.tcp, pair.unix):
            events = 0
            if sock not in pair.eof and not pair.pending[pair.other(sock)]:
                events |= selectors.EVENT_READ
            if pair.pending[sock]:
                events |= selectors.EVENT_WRITE
            try:
                self.sel.get_key(sock)
                if events:
                    self.sel.modify(sock, events, pair)
                else:
                    self.sel.unregister(sock)
            except KeyError:
                if events:
                    self.sel.register(sock, events, pair)

    def _close(self, pair):
        pair.closed = True
        for sock in (pair.tcp, pair.unix):
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self.open[pair.port] -= 1
        if self.open[pair.port] == MAX_PER_PORT - 1:
            self.sel.register(self.listeners[pair.port][0], selectors.EVENT_READ, pair.port)


def start():
    """Bind the ports ``HERMES_SERVICE_FORWARD`` names and relay them in a daemon thread;
    nothing when it is unset. Raises OSError when a port cannot be bound."""
    spec = os.environ.pop(ENV, "")
    routes = []
    for item in spec.split():
        port, _, path = item.partition("=")
        routes.append((int(port), path))
    if not routes:
        return None
    fwd = Forwarder(routes)
    threading.Thread(target=fwd.run, name="hermes-service-forward", daemon=True).start()
    return fwd


def proxy_for_children_only():
    """With ``HERMES_SERVICE_PROXY_CHILDREN_ONLY=1`` (taken out of the environment): the Hermes
    process ignores the proxy variables itself (``NO_PROXY=*``, which httpx and requests
    read as "no proxy") and every process it starts through :mod:`subprocess` gets them as
    the service set them. Each HTTP client Hermes makes (one per turn for the model) then
    builds no proxy transports: measured, an httpx client with the three proxy variables
    costs ~120 ms more to make (one TLS context each)."""
    if os.environ.pop(CHILDREN_ONLY_ENV, None) != "1":
        return
    theirs = {name: os.environ[name] for name in NO_PROXY_NAMES if name in os.environ}
    for name in NO_PROXY_NAMES:
        os.environ[name] = "*"
    import functools
    import subprocess
    original = subprocess.Popen.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        env = kwargs.get("env")
        env = dict(os.environ) if env is None else dict(env)
        for name in NO_PROXY_NAMES:
            if env.get(name) == "*":
                if name in theirs:
                    env[name] = theirs[name]
                else:
                    del env[name]
        kwargs["env"] = env
        return original(self, *args, **kwargs)
    subprocess.Popen.__init__ = __init__  # type: ignore[method-assign]

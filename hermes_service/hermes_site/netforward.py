"""The sandbox's forwarder: its loopback ports to the Unix sockets the service bound into it
(``hermes.sandbox.network: isolated``; docs/sandbox.md §Network). Standard library only: it
runs inside the Hermes process, started by ``sitecustomize`` before Hermes's own code.

``HERMES_SERVICE_FORWARD`` (taken out of the environment, so nothing Hermes starts sees it)
lists ``<port>=<socket path>`` pairs separated by spaces. :func:`start` binds each port on
``127.0.0.1`` at once — before Hermes runs, so nothing else in the sandbox can take a port
first and Hermes's first request finds it listening — and one daemon thread relays every
connection to its socket with non-blocking sockets and :mod:`selectors`: one thread however
many connections, at most :data:`MAX_PER_PORT` open per port (past it the port stops
accepting until one ends: the rest wait in the backlog). The bytes go socket → a pipe →
socket inside the kernel (``os.splice``, :data:`CHUNK` at a time; a pipe exists only while
bytes wait in it), else — no splice here, or no file descriptor left for a pipe — through
:data:`BUFFER`-byte reads; a side is read only once what it sent before was written on.
Being inside Hermes, the forwarder lives and dies with it, and no tool can end it without
ending Hermes.
"""
import errno
import fcntl
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
CHUNK = 1 << 20                 # bytes asked of one splice (the pipe is made that large)
BUFFER = 256 * 1024             # bytes of one read without splice
_SPLICE = getattr(os, "splice", None)
_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class _Pair:
    """One relayed connection: the sandbox-side TCP socket and the service-side Unix socket,
    the bytes waiting to be written to each (read into Python, or ``[read end, write end,
    count]`` of a pipe), and which sides have ended their input."""

    def __init__(self, port, tcp, unix):
        self.port, self.tcp, self.unix = port, tcp, unix
        self.pending = {tcp: b"", unix: b""}
        self.pipes = {}
        self.eof = set()
        self.closed = False

    def other(self, sock):
        return self.unix if sock is self.tcp else self.tcp

    def waiting(self, dst):
        """Are bytes waiting to be written to ``dst``?"""
        return bool(self.pending[dst]) or dst in self.pipes

    def drop_pipe(self, dst):
        for fd in self.pipes.pop(dst, [])[:2]:
            os.close(fd)


def _splice_in(pair, sock, dst):
    """Bytes ``sock`` → a pipe for ``dst``: the count (0 at the end of input), -1 when there
    is nothing to read now, None when splice cannot be used (read into Python instead)."""
    if _SPLICE is None:
        return None
    if dst not in pair.pipes:
        try:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:                 # no file descriptor left for a pipe
            return None
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, CHUNK)
        except OSError:
            pass
        pair.pipes[dst] = [r, w, 0]
    pipe = pair.pipes[dst]
    try:
        n = _SPLICE(sock.fileno(), pipe[1], CHUNK, flags=_FLAGS)
    except BlockingIOError:
        n = -1
    except OSError as exc:
        n = None if exc.errno in (errno.EINVAL, errno.ENOSYS) else 0
    if not n or n < 0:
        pair.drop_pipe(dst)
        return n
    pipe[2] += n
    return n


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
        dst = pair.other(sock)
        n = _splice_in(pair, sock, dst)
        if n is None:
            try:
                data = sock.recv(BUFFER)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            pair.pending[dst] = data
            n = len(data)
        if n < 0:
            return
        if n:
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
        pipe = pair.pipes.get(dst)
        try:
            if pipe is not None and _SPLICE is not None:
                while pipe[2]:
                    pipe[2] -= _SPLICE(pipe[0], dst.fileno(), pipe[2], flags=_FLAGS)
                pair.drop_pipe(dst)
            else:
                sent = dst.send(pair.pending[dst])
                pair.pending[dst] = pair.pending[dst][sent:]
        except BlockingIOError:
            pass
        except OSError:
            self._close(pair)
            return
        self._watch(pair)

    def _watch(self, pair):
        """Read a side only while what it sent has been written on; write while a side has
        bytes waiting. Over once the service's side has ended and its bytes are delivered."""
        if pair.closed:
            return
        if pair.unix in pair.eof and not pair.waiting(pair.tcp):
            self._close(pair)
            return
        for sock in (pair.tcp, pair.unix):
            events = 0
            if sock not in pair.eof and not pair.waiting(pair.other(sock)):
                events |= selectors.EVENT_READ
            if pair.waiting(sock):
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
            pair.drop_pipe(sock)
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

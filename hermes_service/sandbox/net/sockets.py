"""The only ways out of a sandbox's network namespace: Unix sockets of its own
(``hermes.sandbox.network: isolated``; docs/sandbox.md §Network).

A sandbox in its own network namespace sees nothing of the host's network but its own
loopback. For each sandbox the service opens one folder of Unix sockets
(:meth:`SandboxNet.attach`), bound read-only into the sandbox at :data:`INSIDE_DIR`:

* ``model.sock`` — relayed to the model pass-through (:mod:`hermes_service.model_proxy`,
  which still checks the process's credential);
* ``service.sock`` — relayed to this service's own HTTP port (the mnote tool endpoint, which
  checks the run token);
* ``egress.sock`` — the egress proxy (:mod:`hermes_service.sandbox.net.egress_proxy`), under the
  sandbox's policy.

Inside, a forwarder (socat, started by the launcher before Hermes) offers each socket on the
sandbox's own loopback (:data:`PORTS`). Every connection is counted against its sandbox:
at most :attr:`Caps.model` / :attr:`Caps.service` / :attr:`Caps.egress` open at once per
sandbox (at the cap the service stops accepting on that socket until one ends: the rest wait
in, or are refused by, the kernel's backlog), so a sandbox opening thousands of connections
exhausts only its own share — never the
pass-through's, the service's or another sandbox's. One asyncio loop on its own thread
serves every socket of every sandbox; every relay is :mod:`.relay` (in the
kernel where it can, waiting for the other side to take each piece: back-pressure, no
buffering of whole bodies). Each sandbox looks names up on threads of its own
(:mod:`.lookups`), and its refusals reach the log at a rate it cannot raise
(:mod:`.refusals`).

Socket paths can be longer than ``sun_path`` allows (108 bytes): each socket is bound
through ``/proc/self/fd/<folder fd>/<name>``.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ... import instance, metrics
from ...hermes_site import netforward
from . import egress_policy, egress_proxy, relay, service_gate
from .egress_policy import Policy
from .lookups import Lookups
from .refusals import RefusalLog

log = logging.getLogger("hermes_service.sandbox_net")

INSIDE_DIR = "/run/hermes-net"
#: Where each socket is offered on the sandbox's loopback (the forwarder's TCP ports).
PORTS = {"model": 9401, "service": 9402, "egress": 3128}
#: The name the model pass-through goes by inside (the sandbox's /etc/hosts maps it to
#: 127.0.0.1): a dotted name, so Hermes treats the provider as remote, as it would the
#: provider itself (agent/model_metadata.py is_local_endpoint).
MODEL_HOST = "model.hermes.internal"
SOCKETS = ("model", "service", "egress")
#: Read inside Hermes (hermes_site/netforward.py, which declares them): the forwarder's
#: ``<port>=<socket>`` pairs; "1": the Hermes process leaves the proxy to its children.
FORWARD_ENV, CHILDREN_ONLY_ENV = netforward.ENV, netforward.CHILDREN_ONLY_ENV
#: Where a Hermes process reaches this service (``http://host:port``) when that differs
#: from the URL a run file names: the sandbox's own port for ``service.sock``.
SERVICE_URL_ENV = "HERMES_SERVICE_URL"
PROXY_URL = f"http://127.0.0.1:{PORTS['egress']}"
#: The proxy variables of every process in an isolated sandbox (upper and lower case: curl
#: reads only the lower-case http_proxy), and the names that go direct: the sandbox's own
#: loopback and the pass-through's name.
PROXY_ENV = {**{name: PROXY_URL for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                                              "http_proxy", "https_proxy", "all_proxy")},
             **{name: f"localhost,127.0.0.1,::1,{MODEL_HOST}" for name in ("NO_PROXY",
                                                                            "no_proxy")}}


def inside_env(model_url_env: str | None, egress_allowed: bool) -> dict:
    """The environment an isolated sandbox's processes get on top of their own: the
    forwarder's routes, this service's and the pass-through's inside addresses, the proxy
    variables. ``model_url_env``: the variable naming the model endpoint (None: none).
    ``egress_allowed`` False (no destination allowed): the Hermes process leaves the proxy
    to its children (hermes_site/netforward.py ``proxy_for_children_only``)."""
    env = {**PROXY_ENV,
           FORWARD_ENV: " ".join(f"{PORTS[n]}={INSIDE_DIR}/{n}.sock" for n in SOCKETS),
           SERVICE_URL_ENV: f"http://127.0.0.1:{PORTS['service']}"}
    if not egress_allowed:
        env[CHILDREN_ONLY_ENV] = "1"
    if model_url_env:
        env[model_url_env] = f"http://{MODEL_HOST}:{PORTS['model']}/v1"
    return env


def hosts_file(folder: Path) -> Path:
    """The sandbox's ``/etc/hosts`` (written once into ``folder``): loopback names and the
    pass-through's :data:`MODEL_HOST`."""
    path = Path(folder) / "hosts"
    text = (f"127.0.0.1\tlocalhost {MODEL_HOST}\n::1\tlocalhost ip6-localhost "
            "ip6-loopback\n127.0.1.1\thermes\n")
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


@dataclass(frozen=True)
class Caps:
    """Connections one sandbox may hold open at once, per socket (Hermes itself keeps one or
    two to the model and opens one per tool call to this service); its name lookups in
    flight at once (``lookups``) and the seconds one may take (``lookup_timeout``)."""
    model: int = 8
    service: int = 8
    egress: int = 64
    lookups: int = 4
    lookup_timeout: float = 5.0


@dataclass(eq=False)
class Attachment:
    """One sandbox's sockets: ``folder`` (host path, bound at :data:`INSIDE_DIR`), the
    user it serves, connections open now per socket, egress bytes so far, and its own name
    lookups."""
    folder: Path
    user_id: str
    label: str
    open: dict = field(default_factory=lambda: dict.fromkeys(SOCKETS, 0))
    egress_up: int = 0
    egress_down: int = 0
    run_id: str | None = None           # the run its Hermes works on now (set by the runner)
    pace: service_gate.Pace = field(default_factory=service_gate.Pace)
    tasks: set = field(default_factory=set)
    room: dict = field(default_factory=lambda: {n: asyncio.Event() for n in SOCKETS})
    closed: bool = False
    lookups: Lookups = field(default_factory=lambda: Lookups(Caps.lookups, Caps.lookup_timeout))


class SandboxNet:
    """The sockets of every sandbox (see the module doc). ``root``: a service-owned folder
    (``<data_dir>/sandbox/net``), shared by every service process on the data dir: each keeps
    its sandboxes' folders in one of its own, ``<root>/<owner>`` (:func:`instance.current`),
    and removes only the folders of owners no longer alive; ``targets``: ``{"model": (family,
    address), "service": (family, address)}`` — set by :meth:`set_target` once each listens.
    ``on_egress(attachment, outcome)`` is called for every finished egress connection (metrics,
    usage); refusals are logged here (:class:`RefusalLog`). ``resolve``: the name lookup each
    sandbox runs on its own threads (:func:`egress_policy.resolve`; a seam for tests)."""

    def __init__(self, root: Path, policy: Policy | None = None, caps: Caps | None = None,
                 on_egress: Callable | None = None):
        self.root = Path(root)
        self.own = self.root / instance.current()       # this process's sandboxes' folders
        self.policy, self.caps = policy or Policy(), caps or Caps()
        self.on_egress = on_egress
        self.resolve = egress_policy.resolve
        self.refusals = RefusalLog(log)
        #: where the model and service sockets lead: ``(family, address)``
        self.targets: dict[str, tuple[int, tuple]] = {}
        #: the path prefixes a sandbox may call through ``service.sock``
        #: (sandbox/net/service_gate.py)
        self.service_paths: tuple[str, ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.attachments: set[Attachment] = set()

    # -- lifetime ------------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.call_soon(self._flush_refusals)
                    loop.run_forever()
                self._thread = threading.Thread(target=run, name="sandbox-net", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
                self.root.mkdir(parents=True, exist_ok=True)
                sweep(self.root)                  # the sockets of processes that died
                self.own.mkdir(mode=0o700, exist_ok=True)
        return self._loop

    def _flush_refusals(self) -> None:
        self.refusals.flush()
        loop = self._loop or asyncio.get_running_loop()
        loop.call_later(min(5.0, self.refusals.interval), self._flush_refusals)

    def configure(self, policy: Policy, caps: Caps) -> None:
        """A reloaded policy and caps: for every connection from now on (the lookup caps: for
        every sandbox attached from now on)."""
        self.policy, self.caps = policy, caps

    def set_target(self, name: str, host: str, port: int) -> None:
        """Where socket ``name`` leads, looked up once here (never on the sockets' loop).
        Raises OSError when ``host`` does not resolve."""
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.targets[name] = (family, address)

    def close(self) -> None:
        for att in list(self.attachments):
            self.detach(att)
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(5)

    # -- one sandbox -----------------------------------------------------------------
    def attach(self, user_id: str, label: str = "") -> Attachment:
        """Open a new sandbox's sockets. Raises OSError when they cannot be made."""
        loop = self._ensure_loop()
        folder = self.own / uuid.uuid4().hex[:16]
        folder.mkdir(mode=0o700)
        att = Attachment(folder, user_id, label,
                         lookups=Lookups(self.caps.lookups, self.caps.lookup_timeout))
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            socks = []
            for name in SOCKETS:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind(f"/proc/self/fd/{fd}/{name}.sock")
                s.listen(128)
                s.setblocking(False)
                socks.append((name, s))
        except OSError:
            for _, s in socks:
                s.close()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            os.close(fd)
        fut = asyncio.run_coroutine_threadsafe(self._serve(att, socks), loop)
        fut.result(10)
        with self._lock:
            self.attachments.add(att)
        return att

    def detach(self, att: Attachment) -> None:
        """Close a sandbox's sockets (its process ended) and every connection through them."""
        with self._lock:
            if att.closed:
                return
            att.closed = True
            self.attachments.discard(att)
            loop = self._loop
        if loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._stop(att), loop).result(10)
            except Exception:  # closing goes on
                log.exception("closing a sandbox's sockets failed")
        shutil.rmtree(att.folder, ignore_errors=True)

    async def _serve(self, att: Attachment, socks: list) -> None:
        for name, sock in socks:
            att.tasks.add(asyncio.get_running_loop().create_task(self._accept(att, name, sock)))

    async def _stop(self, att: Attachment) -> None:
        tasks = list(att.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        att.lookups.close()
        self.refusals.flush(att)

    async def _accept(self, att: Attachment, name: str, sock: socket.socket) -> None:
        """Accept on one socket while the sandbox has fewer than its cap open there; at the
        cap, stop accepting (the kernel's backlog holds or refuses the rest: they cost the
        service nothing) until one of its connections ends."""
        loop = asyncio.get_running_loop()
        room = att.room[name]
        try:
            while True:
                while att.open[name] >= getattr(self.caps, name):
                    room.clear()
                    await room.wait()
                conn, _ = await loop.sock_accept(sock)
                att.open[name] += 1
                task = loop.create_task(self._connection(att, name, conn))
                att.tasks.add(task)
                task.add_done_callback(att.tasks.discard)
        except asyncio.CancelledError:
            pass
        finally:
            sock.close()

    async def _connection(self, att: Attachment, name: str, conn: socket.socket) -> None:
        try:
            if name == "egress":
                out = await egress_proxy.serve(conn, self.policy, functools.partial(
                    att.lookups.resolve, self.resolve))
                att.egress_up += out.up
                att.egress_down += out.down
                if out.refused:
                    self.refusals.refused(att, out.refused, (
                        f"egress refused for user={att.user_id} run={att.run_id or '-'}: "
                        f"{out.host or '?'}:{out.port or '?'}"), "egress")
                if self.on_egress is not None:
                    self.on_egress(att, out)
            elif name == "service":
                await self._gate(att, conn)
            else:
                await self._relay(name, conn)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - one connection never stops the loop
            self.refusals.refused(att, "error", f"sandbox {name} connection failed for "
                                  f"user={att.user_id}", name, exc_info=exc)
        finally:
            att.open[name] -= 1
            att.room[name].set()
            conn.close()

    async def _gate(self, att: Attachment, conn: socket.socket) -> None:
        target = self.targets.get("service")
        if target is None:
            return
        refused = await service_gate.forward(conn, target, self.service_paths, att.pace)
        if refused:
            metrics.sandbox_request_refused(refused)
            self.refusals.refused(att, refused, "sandbox request to this service refused for "
                                  f"user={att.user_id} run={att.run_id or '-'}", "service")

    async def _relay(self, name: str, conn: socket.socket) -> None:
        target = self.targets.get(name)
        if target is None:
            return
        far = socket.socket(target[0], socket.SOCK_STREAM)
        far.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(far, target[1]), 10)
            await relay.both(conn, far)
        except (TimeoutError, OSError):
            pass
        finally:
            far.close()


def sweep(root: Path) -> list[str]:
    """Remove the folders under ``root`` whose owner process is gone (a crash leaves them);
    those of live processes — another service process on the data dir — stay. Returns the
    owners removed."""
    gone = []
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and not instance.alive(entry.name):
            shutil.rmtree(entry.path, ignore_errors=True)
            gone.append(entry.name)
    return gone


def report_egress(att: Attachment, out: egress_proxy.Outcome) -> None:
    """One finished egress connection: a metric (no user label), and for one that went
    through an info line naming the user, the run (when one is running there) and the bytes
    each way (per user, docs/operations.md §Logs). Refusals are logged by
    :class:`SandboxNet` (:class:`RefusalLog`: once per sandbox and reason an interval)."""
    metrics.egress_connection(out.refused or "ok", out.up, out.down)
    if not out.refused:
        log.info("egress user=%s run=%s: %s:%s up=%d down=%d", att.user_id, att.run_id or "-",
                 out.host or "?", out.port or "?", out.up, out.down)

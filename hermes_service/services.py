"""The service objects, built in one place (docs/architecture.md).

Data flows one way: blueprint → these objects → runner/store. :func:`build_services`
constructs every object from the config and wires them together; :meth:`Services.apply`
hands a reloaded config to the same objects (docs/configuring.md §Reload). Process reaping (killing
CLI groups a crashed service left) and the periodic cleanup
(:class:`~hermes_service.retention.RetentionJob`) are the serve command's job
(:mod:`hermes_service.cli`), not a side effect of building these.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import installed, metrics
from .config import Config
from .conversations import Conversations
from .disk.quota import Disk
from .errors import ServiceError, TooManyRuns, Unconfigured
from .homes.users import HERMES_SITE, UserHomes
from .idempotency import DB_NAME as IDEMPOTENCY_DB
from .idempotency import IdempotencyStore
from .limits import Limiter
from .model_proxy.policy import offered_models
from .model_proxy.proxy import ModelProxy
from .model_proxy.upstream import upstream_proxy_for
from .model_proxy.usage import usage_db_path
from .runner import AcpRunner, CliProcess, CliRunner, Processes, RunnerChoice, acp_families
from .sandbox import Sandbox
from .security import Guard
from .session_store import SessionStore

if TYPE_CHECKING:      # imported when storage.url is set only (psycopg)
    from .storage.idempotency import PgIdempotencyStore
    from .storage.node import SharedNode
    from .storage.sessions import PgSessionStore

#: ``Retry-After`` of 503 ``service_draining``, seconds: behind nginx a retry reaches another
#: node; alone, the restarted service is usually back within a drain.
DRAINING_RETRY_AFTER = 5


@dataclass
class Services:
    """The service objects shared by the blueprints (one set per app)."""
    config: Config
    guard: Guard
    store: SessionStore | PgSessionStore
    homes: UserHomes
    processes: Processes               # every Hermes process: slots, groups, the launcher
    runner: CliRunner               # the CLI runner (runners.cli)
    runners: RunnerChoice              # which runner takes a turn (the CLI or the ACP one)
    conversations: Conversations
    admitted: Limiter = field(repr=False)
    sandbox: Sandbox = field(repr=False)             # the launcher of Hermes processes
    disk: Disk = field(repr=False)                   # quotas, floor, the disk watcher
    model_proxy: ModelProxy = field(repr=False)      # the provider pass-through
    idempotency: IdempotencyStore | PgIdempotencyStore = field(repr=False)  # Idempotency-Keys
    #: where Hermes processes call this service back (the serve command's address), or None
    service_url: str | None = None
    #: the shared storage of several nodes (storage.url), or None: a single node
    shared: SharedNode | None = field(repr=False, default=None)
    #: what the enabled extensions built, by extension name (hermes_service/extensions.py)
    extensions: dict = field(repr=False, default_factory=dict)
    #: the extensions' cleanup steps (:class:`~hermes_service.extensions.RetentionStep`)
    retention_steps: list = field(repr=False, default_factory=list)
    #: what else a drain waits for: objects with ``in_flight() -> {key: label}`` and
    #: ``outcome(key) -> str | None`` (None: not its key) (:meth:`in_flight`)
    drain_sources: list = field(repr=False, default_factory=list)
    #: ``fn(config)`` called by :meth:`apply` with a reloaded config (the extensions')
    reloaders: list = field(repr=False, default_factory=list)
    #: v1 requests holding an admission place now (message, execute, delete), by a label
    #: naming them for the drain's log lines (:meth:`in_flight`)
    _v1_turns: dict = field(repr=False, default_factory=dict)
    _v1_lock: threading.Lock = field(repr=False, default_factory=threading.Lock)
    _v1_outcomes: dict = field(repr=False, default_factory=dict)    # while draining

    def require_provider(self) -> None:
        """Raise :class:`Unconfigured` (503 ``hermes_unconfigured``) when no model turn can
        work (:attr:`Config.provider_issues`: no provider, the shipped example, or an unset
        key variable), so a turn is refused at once instead of running the CLI."""
        issues = self.config.provider_issues
        if issues:
            reason = issues[0].split(": ", 1)[-1]
            raise Unconfigured(reason, code="hermes_unconfigured")

    def apply(self, config: Config) -> None:
        """Hand a reloaded, validated config to the service objects (docs/configuring.md §Reload):
        each takes its section in its ``configure`` (the same sections :func:`build_services` built
        them from); the guard is rebuilt.

        Applies to new requests: keys, allowlist and trusted proxies (a new Guard), model
        settings, template and extra env (user homes, refreshed on their next run), command,
        toolsets and time limits (processes), turn slots and v1 admission places, message size,
        execute allowlist, the idempotency records' lifetime (from their next outcome), what
        the extensions' reload hooks (:attr:`reloaders`) apply, and log level
        (``service.drain_seconds`` is read from :attr:`config` when a stop begins). Runs in flight
        keep their process, limits and token. ``config`` must carry the running values of its
        restart-only keys (:attr:`~hermes_service.config.Config.restart_only_keys`).
        """
        h = config.hermes
        before = (self.config.hermes, self.homes.configured)
        self.homes.configure(config.paths, h)
        self.sandbox.configure(h.sandbox)
        self.disk.configure(h.sandbox)
        self.model_proxy.configure(**model_proxy_settings(config, self.homes))
        self.processes.configure(h)
        if self.runners.acp is not None:
            # warm processes run with the old settings and template: retire them only when
            # those changed (a reload that rotates a key keeps every user's process warm)
            self.runners.acp.configure(h, retire=(h, self.homes.configured) != before)
        self.conversations.configure(h)
        self.idempotency.configure(config.service.idempotency_ttl_seconds,
                                   config.service.idempotency_max_records_per_key)
        for reload in self.reloaders:
            reload(config)
        self.admitted.resize(h.admission_places)
        logging.getLogger().setLevel(config.service.log_level.upper())
        self.guard = Guard(config.security, config.nginx)
        self.config = config

    @property
    def draining(self) -> bool:
        """Is the service draining (docs/operations.md §Process lifetime): no new turn is
        accepted."""
        return self.processes.draining

    def drain(self) -> None:
        """Stop accepting new turns (:meth:`check_accepting` refuses them), let the running
        ones go on; the warm ACP pool starts no new process and pre-warms nothing
        (docs/operations.md §Process lifetime). :meth:`shutdown` ends what is left."""
        self.processes.draining = True
        metrics.set_draining(True)

    def check_accepting(self) -> None:
        """Raise 503 ``service_draining`` (``Retry-After: 5``) while draining: a route that
        would start a Hermes turn calls this before it accepts one."""
        if self.processes.draining:
            raise ServiceError("the service is stopping and takes no new turns; retry "
                               "(behind a proxy another node answers)",
                               code="service_draining", status=503,
                               headers={"Retry-After": str(DRAINING_RETRY_AFTER)})

    def in_flight(self) -> dict:
        """What a drain waits for (docs/operations.md §Process lifetime): ``{key: label}``, one
        entry per v1 request holding an admission place (label ``v1 message on session <id>``, …)
        and what the :attr:`drain_sources` name (e.g. ``run <runId>``)."""
        with self._v1_lock:
            out = dict(self._v1_turns)
        for source in self.drain_sources:
            out.update(source.in_flight())
        return out

    def outcome(self, key) -> str:
        """How an entry of :meth:`in_flight` ended, once it left: ``ok`` or the error code of
        a v1 request (recorded while draining), what its drain source says (e.g. the terminal
        event of a run: ``run.completed``, ``run.failed <code>``); ``?`` when unknown."""
        for source in self.drain_sources:
            said = source.outcome(key)
            if said is not None:
                return said
        with self._v1_lock:
            return self._v1_outcomes.pop(key, "?")

    def shutdown(self) -> int:
        """Stop starting Hermes processes, kill every running group (CLI turns, ACP
        processes) and stop the ACP runner's loop. Returns how many groups were killed."""
        self.processes.stopping = True
        killed = self.processes.kill_all()
        if self.runners.acp is not None:
            self.runners.acp.close()
        self.model_proxy.stop()
        self.sandbox.close()
        if self.shared is not None:
            self.shared.close()        # leases released: other nodes take these users at once
        return killed

    @contextmanager
    def admission(self, label: str = "v1 request"):
        """Hold one of the ``max_concurrent_runs + max_waiting_requests`` places for a
        synchronous v1 turn (running or waiting), so waiting requests can never take every
        waitress thread. Raises TooManyRuns (429) when none is free. ``label`` names the
        request in the drain's log lines (:meth:`in_flight`)."""
        if not self.admitted.acquire(blocking=False):
            raise TooManyRuns("too many requests are waiting for Hermes; retry later",
                              headers={"Retry-After": "5"})
        token, outcome = object(), "error"
        with self._v1_lock:
            self._v1_turns[token] = label
        try:
            yield
            outcome = "ok"
        except ServiceError as err:
            outcome = err.code
            raise
        finally:
            with self._v1_lock:
                del self._v1_turns[token]
                if self.processes.draining:
                    self._v1_outcomes[token] = outcome
            self.admitted.release()


def default_service_url(config: Config, host: str | None = None, port: int | None = None) -> str:
    """Where a Hermes process reaches this service on this host: ``http://127.0.0.1:<port>``
    (``http://[::1]:<port>`` when serving on an IPv6 host). An extension may prefer an
    address of its own config."""
    host = host or config.service.host
    port = config.service.port if port is None else port
    return f"http://{'[::1]' if ':' in host else '127.0.0.1'}:{port}"


def model_proxy_settings(config: Config, homes: UserHomes) -> dict:
    """:meth:`ModelProxy.configure`'s arguments for ``config``: the provider, its key's
    variable, the read timeout (a turn's hard limit), the HTTP proxy ``hermes.extra_env``
    names for it, the model names a home may ask for (its rendered config's and the enabled
    extensions': :func:`~hermes_service.model_proxy.policy.offered_models`), the context length
    (the body cap) and ``hermes.limits.daily_tokens``."""
    hermes = config.hermes
    try:
        rendered = homes.render_config()
    except Unconfigured:               # no template: the central model only
        rendered = {"model": {"default": hermes.model.default}}
    return {"upstream_base_url": hermes.model.base_url, "api_key_env": hermes.model.api_key_env,
            "read_timeout": float(hermes.timeout_seconds),
            "upstream_proxy": upstream_proxy_for(hermes.extra_env, hermes.model.base_url),
            "models": offered_models(rendered, installed.model_names(config)),
            "context_length": hermes.model.context_length,
            "daily_tokens": hermes.limits.daily_tokens}



def shared_node(config: Config, homes: UserHomes, processes: Processes,
                service_url: str) -> SharedNode | None:
    """The shared storage of several nodes (:class:`~hermes_service.storage.node.SharedNode`)
    when ``storage.url`` is set, else None (a single node: everything on its own disk). Its
    homes' claim hook takes a user's lease (and restores the home) before the home is used;
    a lost lease kills the user's Hermes processes here."""
    if not config.storage.enabled:
        return None
    from urllib.parse import urlsplit

    from .storage.node import SharedNode

    def stop_user(user_id: str) -> int:
        return processes.groups.kill_home(str(homes.path(user_id).hermes_home),
                                          "the user's lease went to another node")

    def make_folder(path) -> None:
        """A restored home's new folder: the disk's (a btrfs subvolume with the quota), else
        a plain one (as a new home is made)."""
        if homes.make_folder is not None:
            homes.make_folder(path)
        if not path.exists():
            path.mkdir(mode=0o700)

    shared = SharedNode(config, home_of=lambda u: homes.path(u).root, stop_user=stop_user,
                        make_folder=make_folder, port=urlsplit(service_url).port)
    homes.claim = shared.claim
    return shared


def idempotency_store(config: Config, shared: SharedNode | None):
    """The Idempotency-Key records: ``data/idempotency.db`` on a single node, the shared
    PostgreSQL's table with ``storage.url`` (a retry on another node replays)."""
    ttl, most = (config.service.idempotency_ttl_seconds,
                 config.service.idempotency_max_records_per_key)
    if shared is None:
        return IdempotencyStore(config.data_dir / IDEMPOTENCY_DB, ttl, max_records_per_key=most)
    from .storage.idempotency import PgIdempotencyStore
    return PgIdempotencyStore(shared.ownership, ttl, most)


def build_services(config: Config, service_url: str | None = None) -> Services:
    """Construct every service object for ``config``, each from its section (the same
    sections :meth:`Services.apply` hands them on reload).

    Then every extension ``config`` enables builds its own objects
    (:meth:`~hermes_service.extensions.Extension.init_services`).

    Raises :class:`~hermes_service.session_store.CorruptStore` if the session registry
    cannot be opened (its layout file, or a legacy ``sessions.json`` to migrate, is
    unusable), :class:`~hermes_service.extensions.StoreUnusable` if an extension's store
    cannot: the service must not start.
    """
    data_dir = config.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    hermes = config.hermes
    homes = UserHomes(config.paths, hermes)
    sandbox = Sandbox(hermes.sandbox, data_dir, HERMES_SITE)
    disk = Disk(hermes.sandbox, data_dir, config.paths.homes, config.storage.enabled)
    homes.make_folder, homes.mount = disk.make_folder, disk.mount_existing
    proxy = ModelProxy(usage_db=usage_db_path(data_dir), **model_proxy_settings(config, homes))
    sandbox.credentials = proxy      # started by the first Hermes process that needs it
    processes = Processes(hermes, pid_dir=data_dir / "pids", run_dir=config.paths.homes / "runs",
                          sandbox=sandbox, disk=disk)
    processes.families = {f.name: f for f in installed.route_families(config)}
    service_url = service_url or default_service_url(config)
    shared = shared_node(config, homes, processes, service_url)
    if shared is not None:              # the daily budget counts every node's requests
        from .storage.usage import PgUsageStore
        proxy.usage.close()
        proxy.usage = PgUsageStore(shared.engine)
    store = SessionStore(data_dir) if shared is None else shared.sessions
    families = acp_families(processes.families.values())
    def process_env(user_id: str):
        """A new warm process's home and environment, from the settings in force."""
        home = homes.ensure(user_id)
        return home, homes.cli_env(home, processes.command_path())
    acp = AcpRunner(hermes, processes, process_env) if families else None
    runners = RunnerChoice(CliRunner(processes), acp, families)
    services = Services(
        config=config, guard=Guard(config.security, config.nginx), store=store, homes=homes,
        processes=processes, runner=runners.cli, runners=runners,
        conversations=Conversations(config, store, homes, processes, runners, shared),
        admitted=Limiter(hermes.admission_places),
        sandbox=sandbox, disk=disk, model_proxy=proxy,
        idempotency=idempotency_store(config, shared),
        service_url=service_url, shared=shared)
    sandbox.serve_back(service_url)     # an isolated sandbox's way back to us
    if shared is not None:              # the home chunks no snapshot names any more
        from .extensions import RetentionStep
        services.retention_steps.append(RetentionStep(("home chunks",), shared.collect))
    # gauges read at scrape time (docs/operations.md §Metrics)
    metrics.watch("runner_processes", lambda: processes.groups.count(CliProcess), runner="cli")
    if acp is not None:
        metrics.watch("runner_processes", acp.process_count, runner="acp")
    metrics.watch("registry_sessions", store.count)
    for ext in installed.enabled(config):
        ext.init_services(services)
    return services

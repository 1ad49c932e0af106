"""The service objects, built in one place (README §Architecture).

Data flows one way: blueprint → these objects → runner/store. :func:`build_services`
constructs every object from the config and wires them together; nothing is patched
after construction. Process reaping (killing CLI groups a crashed service left) is the
serve command's job (:mod:`hermes_service.cli`), not a side effect of building these.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import metrics
from .config import Config
from .conversations import Conversations
from .errors import TooManyRuns
from .mnote.gateway import ToolGateway
from .mnote.page_store import SQLitePageStore
from .runner import HermesRunner
from .runs import RunManager
from .security import Guard
from .session_store import SessionStore
from .user_homes import UserHomes


@dataclass
class Services:
    """The service objects shared by the blueprints (one set per app)."""
    config: Config
    guard: Guard
    store: SessionStore
    homes: UserHomes
    runner: HermesRunner
    conversations: Conversations
    runs: RunManager                   # background runs + events (mnote client)
    tools: ToolGateway                 # run tokens + tool calls (mnote tools)
    admitted: threading.BoundedSemaphore = field(repr=False, default=None)

    @contextmanager
    def admission(self):
        """Hold one of the ``max_concurrent_runs + max_waiting_requests`` places for a
        synchronous v1 turn (running or waiting), so waiting requests can never take every
        waitress thread. Raises TooManyRuns (429) when none is free."""
        if not self.admitted.acquire(blocking=False):
            raise TooManyRuns("too many requests are waiting for Hermes; retry later",
                              headers={"Retry-After": "5"})
        try:
            yield
        finally:
            self.admitted.release()


def default_service_url(config: Config, host: str | None = None, port: int | None = None) -> str:
    """Where the Hermes CLI calls this service back (tool calls): ``mnote.service_url``, or
    ``http://127.0.0.1:<port>`` (``http://[::1]:<port>`` when serving on an IPv6 host)."""
    if config["mnote"]["service_url"]:
        return config["mnote"]["service_url"]
    host = host or config["service"]["host"]
    port = config["service"]["port"] if port is None else port
    return f"http://{'[::1]' if ':' in host else '127.0.0.1'}:{port}"


def build_services(config: Config, service_url: str | None = None) -> Services:
    """Construct every service object for ``config``.

    Raises :class:`~hermes_service.session_store.CorruptStore` if ``sessions.json`` is
    unreadable (the service must not start).
    """
    config.data_dir.mkdir(parents=True, exist_ok=True)
    hermes = config["hermes"]
    store = SessionStore(config.data_dir / "sessions.json")
    homes = UserHomes(config)
    runner = HermesRunner(hermes, pid_dir=config.data_dir / "pids")
    services = Services(
        config=config, guard=Guard(config), store=store, homes=homes, runner=runner,
        conversations=Conversations(config, store, homes, runner),
        runs=RunManager(config["mnote"]["events_retention_seconds"],
                        max_active=hermes["max_concurrent_runs"] * 4,
                        max_streams=config["mnote"]["max_event_streams"]),
        tools=ToolGateway(SQLitePageStore(config.data_dir / "mnote.db"),
                          service_url or default_service_url(config)),
        admitted=threading.BoundedSemaphore(hermes["max_concurrent_runs"]
                                            + hermes["max_waiting_requests"]))
    # gauges read at scrape time (README §Operations → Metrics)
    metrics.watch("runner_processes", runner.running, runner="cli")
    metrics.watch("registry_sessions", store.count)
    metrics.watch("runs_active", services.runs.active)
    return services

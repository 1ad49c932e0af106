"""How the mnote extension wires itself into the core (:mod:`hermes_service.extensions`).

:class:`MnoteExtension` is the one object the core knows (through
:func:`hermes_service.installed.extensions`). It brings the ``mnote`` config section
(:mod:`.settings`: schema, defaults, :class:`~.settings.MnoteSettings`, its check, its
restart-only keys, the threads its event streams hold), and from that section
(:func:`~.objects.settings`) it

* declares the ``mnote`` route family (:meth:`~MnoteExtension.families`): its runner
  (``mnote.runner``), ``panel`` in the start line, its turns ask their user, and ``mnote_*``
  tool calls are reported by the tool gateway;
* builds its objects (:class:`Mnote`: the page store — ``data/mnote.db``, or mnote's kernel
  with ``mnote.page_store.kind`` command or http (then ``data/mnote.db`` is not opened) —, the
  tool gateway, the
  run manager with its durable event logs ``data/run-events/``) as
  ``services.extensions["mnote"]`` (:func:`mnote_of`), with its reload hook, its drain source
  (runs queued or running), its retention steps and its gauges;
* registers its blueprints, error shapes and OpenAPI components (its run events, the tool
  envelope, the ``X-Trace-Id`` response header, its tags and description) on the app, and the
  ``mnote`` command group (:mod:`.cli`);
* at serve start, closes the runs of a service process that died.

``mnote.enabled: false`` switches it off: none of that is built or registered (the ``mnote``
commands say so and exit 2).
"""
from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ..extensions import Extension, Family, RetentionStep
from .objects import NAME, Mnote, mnote_of, run_limits, settings
from .settings import SECTION

if TYPE_CHECKING:
    from ..config import Config, ConfigSection

    # the shape of Services (services builds the extensions: no import cycle)
    from ..service_objects import ServiceObjects

log = logging.getLogger("hermes_service")

#: the OpenAPI tags of its routes
TAGS = [
    {"name": "client", "description": "The mnote client proxy (contract "
                                      "hermes-client-proxy-contract-v1; "
                                      "docs/mnote-client.md). Errors: `{ok: false, code, "
                                      "message, traceId, requestId}`."},
    {"name": "tools", "description": "The mnote tool endpoint (contract "
                                     "mnote-hermes-plugin-tool-contract-v1; "
                                     "docs/mnote-tools.md): loopback only, a run token "
                                     "instead of an API key."},
]


# -- retention steps (docs/data-and-durability.md#retention-and-cleanup)
# ------------------------------------
def _page_store_idempotency(svc, report, *, now, dry_run, in_service) -> None:
    """Page-store idempotency records older than ``retention.idempotency_window_seconds``."""
    store = mnote_of(svc).store
    if store is None:                 # mnote's kernel keeps its own records
        return
    window = float(svc.config.retention.idempotency_window_seconds)
    before = datetime.fromtimestamp(now - window, UTC)
    n = store.prune_idempotency(before, dry_run=dry_run)
    if n:
        report.removed("idempotency records", f"{n} page-store idempotency record(s) created "
                       f"before {before.isoformat(timespec='seconds')}", n)


def _run_event_logs(svc, report, *, now, dry_run, in_service) -> None:
    """Run event log files of runs that ended ``mnote.events_retention_seconds`` ago (a run
    whose process died is closed on the way); in the service also finished runs' in-memory
    logs past that age."""
    runs = mnote_of(svc).runs
    n = runs.sweep_files(dry_run=dry_run)
    if n:
        report.removed("run event logs", f"{n} run event log file(s) of runs that ended more "
                       f"than mnote.events_retention_seconds ago", n)
    if in_service and not dry_run:
        n = runs.sweep()
        report.removed("event logs", f"{n} finished run(s)' event logs" if n else None, n)


RETENTION_STEPS = (RetentionStep(("idempotency records",), _page_store_idempotency),
                   RetentionStep(("run event logs", "event logs"), _run_event_logs))


class MnoteExtension(Extension):
    """The mnote extension's hooks (module doc)."""
    name = NAME

    def config_section(self) -> ConfigSection:
        """The ``mnote`` section (:data:`.settings.SECTION`)."""
        return SECTION

    def enabled(self, config: Config) -> bool:
        """``mnote.enabled`` (default true): false removes the extension
        (docs/mnote-client.md). Off too in a config built without its section (the core's
        :func:`hermes_service.config.build_config` alone)."""
        return NAME in config.extensions and bool(settings(config).enabled)

    @property
    def demo(self):
        """``make demo``: the mnote panel against a scripted stand-in model (:mod:`.demo`)."""
        from . import demo
        return demo

    def families(self, config: Config) -> list[Family]:
        return [Family(NAME, settings(config).runner, label="panel", asks_user=True,
                       own_tool_prefix="mnote_")]

    def model_names(self, config: Config) -> list[str]:
        """The ``hermes_model`` of each of ``mnote.models`` (a run passes it with ``-m``)."""
        return [m.hermes_model for m in settings(config).models if m.hermes_model]

    def init_services(self, services: ServiceObjects) -> None:
        """Build the page store (or the kernel adapter), tool gateway and run manager. Raises
        :class:`~.page_store.PageStoreUnusable` if ``data/mnote.db`` cannot be opened."""
        from . import metrics
        from .gateway import ToolGateway
        from .kernel.adapter import backend_for
        from .page_sqlite import SQLitePageStore
        from .runs.log import RunLogs
        from .runs.manager import RunManager
        config, cfg = services.config, settings(services.config)
        runs = RunManager(*run_limits(config), logs=RunLogs(config.data_dir / "run-events"))
        runs.streams_per_actor = cfg.max_streams_per_actor
        if services.shared is not None:        # several nodes: finished runs replay anywhere
            runs.archive = services.shared.runs
        backend = backend_for(cfg.page_store)
        store = SQLitePageStore(config.data_dir / "mnote.db") if backend is None else None
        tools = ToolGateway(store, cfg.service_url or services.service_url, backend=backend)
        if cfg.service_url:
            services.sandbox.serve_back(cfg.service_url)   # isolated sandboxes reach it there
        # an abort that reaches this process from another one revokes the run's token too
        runs.on_abort.append(tools.end_run)
        mnote = services.extensions[NAME] = Mnote(store, tools, runs)
        services.reloaders.append(mnote.configure)
        services.drain_sources.append(mnote)
        services.retention_steps.extend(RETENTION_STEPS)
        metrics.watch_runs(runs)      # gauges read at scrape time (docs/operations.md#metrics)

    def init_app(self, app, services: ServiceObjects) -> None:
        """Register the mnote blueprints (with their route families: auth, scopes, error
        shapes; :mod:`hermes_service.web.routing`) on ``app``."""
        from ..web.helpers import (
            register_components,
            register_description,
            register_response_headers,
            register_tags,
        )
        from . import (  # noqa: F401
            client,
            client_runs,
            client_schemas,
            client_suggestions,
            endpoint,
            events,
        )
        # (client_runs, client_suggestions: their routes join client.bp when imported)
        app.register_blueprint(client.bp)
        app.register_blueprint(client.legacy_bp)
        app.register_blueprint(endpoint.bp)
        register_components(app, events.COMPONENTS)     # the run events in /openapi.json
        register_components(app, endpoint.COMPONENTS)   # the tool envelope
        register_response_headers(app, client_schemas.RESPONSE_HEADERS)
        register_tags(app, TAGS)
        register_description(app, "the mnote client proxy (the page AI panel; its runs stream "
                             "Server-Sent Events)", "client proxy `{ok: false, code, message, "
                             "traceId, requestId}`")
        register_description(app, "the mnote tool endpoint",
                             "tool endpoint the contract's output envelope")

    def init_cli(self, group) -> None:
        from .cli import mnote
        group.add_command(mnote)

    def on_serve(self, services: ServiceObjects) -> None:
        closed = mnote_of(services).runs.close_dead()
        if closed:
            log.warning("closed %d run(s) of a service process that died (run.failed "
                        "run_interrupted)", closed)

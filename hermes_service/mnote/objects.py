"""The mnote objects of one set of service objects and its view of the ``mnote`` config
section (:func:`settings`; the section itself: :mod:`.settings`).

Kept apart from :mod:`.extension` (which builds them and imports the blueprints) so that the
blueprints and commands reading them close no import cycle (tests/unit/test_layers_imports.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .settings import NAME, max_active_runs

if TYPE_CHECKING:
    from ..config import Config

    # the shape of Services (services builds the extensions: no import cycle)
    from ..service_objects import ServiceObjects
    from .gateway import ToolGateway
    from .page_sqlite import SQLitePageStore
    from .runs.manager import RunManager
    from .settings import MnoteSettings


def settings(config: Config) -> MnoteSettings:
    """The ``mnote`` section of ``config`` (:data:`.settings.SECTION`, validated and typed
    with the core's sections by :func:`hermes_service.config.build_config`). KeyError for a
    config built without it."""
    return config.section(NAME)


def run_limits(config: Config) -> tuple[float, int, int]:
    """:class:`~.runs.RunManager`'s limits: finished runs kept (seconds), runs queued or
    running at once (:func:`max_active_runs`), event streams open at once."""
    mnote = settings(config)
    return (mnote.events_retention_seconds, max_active_runs(config), mnote.max_event_streams)


@dataclass
class Mnote:
    """The mnote objects of one set of service objects."""
    store: SQLitePageStore | None   # pages, workspaces, audit (data/mnote.db); None: the kernel
    tools: ToolGateway           # run tokens + tool calls (the tool endpoint)
    runs: RunManager             # background runs + events (the client routes)

    def configure(self, config: Config) -> None:
        """A reloaded config (docs/configuring.md#reload): event retention, run and stream
        limits, an actor's share of the streams."""
        self.runs.configure(*run_limits(config))
        self.runs.streams_per_actor = settings(config).max_streams_per_actor

    # -- drain source (Services.in_flight / outcome) ------------------------------
    def in_flight(self) -> dict:
        """One entry per run queued or running: key and label ``run <runId>``."""
        return {f"run {run_id}": f"run {run_id}" for run_id in self.runs.active_ids()}

    def outcome(self, key) -> str | None:
        """The terminal event of a run that left (``run.completed``, ``run.failed <code>``,
        ``run.cancelled``; ``?`` unknown); None for a key that is not a run's."""
        if not (isinstance(key, str) and key.startswith("run ")):
            return None
        run = self.runs.peek(key[4:])
        last = run.events[-1] if run is not None and run.events else None
        if last is None:
            return "?"
        return " ".join(x for x in (last.get("event"), last.get("code")) if x)


def mnote_of(services: ServiceObjects) -> Mnote:
    """The mnote objects of ``services`` (KeyError when the extension is off)."""
    return services.extensions[NAME]

"""The extension seam: how an outer feature package wires itself into the core
(docs/architecture.md).

The core (every module of ``hermes_service`` outside an extension's package) never imports an
extension: :mod:`hermes_service.installed` is the one composition point, the list of the installed
extensions (a module of its own above the core, so that no import cycle closes through it).
Everything else reaches an extension through the hooks of :class:`Extension`, which the core calls
at fixed points — the way flaskr's ``db.init_app(app)`` wires itself:

* :meth:`Extension.config_section` — its section of config.yaml
  (:class:`~hermes_service.config.ConfigSection`: schema, defaults, the builder of its typed
  settings, its named checks, restart-only keys and the threads it holds), validated with the
  core's sections whether the extension is enabled or not
  (:func:`hermes_service.installed.load_config`); its settings are ``config.section(name)``
  (docs/configuring.md §Extension sections);
* :meth:`Extension.enabled` — whether ``config`` switches it on (off: none of the hooks
  below is called, so it builds, registers and serves nothing);
* :meth:`Extension.families` — the route families its turns use (:class:`Family`: runner,
  start-line label, how its Hermes plugin finds a turn's run file), read before the runners
  are built;
* :meth:`Extension.model_names` — the model names its turns may ask Hermes for (the model
  pass-through forwards only the configured ones);
* :meth:`Extension.init_services` — build its objects from ``services.config`` and attach
  them (``services.extensions[name]``); register its retention steps, drain source, reload
  hook and metrics on the :class:`~hermes_service.services.Services` (called by
  :func:`~hermes_service.services.build_services`, so ``gc`` gets them too);
* :meth:`Extension.init_app` — its blueprints, error shapes and OpenAPI components, tags,
  response headers and description (:mod:`hermes_service.web.helpers`'s ``register_*``; called by
  :func:`~hermes_service.app.create_app`);
* :meth:`Extension.init_cli` — its command group (called when :mod:`hermes_service.cli` is
  imported);
* :meth:`Extension.on_serve` — once, by the serve command, before the service listens.

An extension that offers ``make demo`` names its demo module in :attr:`Extension.demo`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import click
    from flask import Flask

    from .config import Config, ConfigSection

    # the shape of hermes_service.services.Services: services builds the extensions, so
    # importing it here would close a cycle (tests/unit/test_layers_imports.py)
    from .service_objects import ServiceObjects


class StoreUnusable(Exception):
    """A store an extension opens when the service objects are built cannot be used (e.g.
    a damaged SQLite file): the service must not start, ``gc`` must not run (exit 3)."""


@dataclass(frozen=True)
class Family:
    """How one route family's turns run (docs/runners.md).

    ``name``: the session ``kind`` and the metrics label (each family has its own ACP
    processes); ``runner``: ``cli`` | ``acp``; ``label``: its name in the start line
    (``runner R (label P)``; None: the core's own family, named first); ``asks_user``: its turns can
    put Hermes's questions to their user (``hermes.approvals.mode: ask`` then offers the clarify
    tool); ``own_tool_prefix``: tool calls whose name starts with it are reported by the extension,
    not by the runner's listener."""
    name: str
    runner: str = "cli"
    label: str | None = None
    asks_user: bool = False
    own_tool_prefix: str | None = None


@dataclass(frozen=True)
class RetentionStep:
    """One cleanup step an extension adds to every retention pass
    (:func:`hermes_service.retention.collect`): ``kinds`` it reports (in the summary's
    order), ``run(svc, report, *, now, dry_run, in_service)`` removes and reports
    (``report.removed(kind, text, n)``)."""
    kinds: tuple[str, ...]
    run: Callable


class Extension:
    """An outer feature package's hooks (module doc); every hook does nothing here."""
    #: its key in ``services.extensions`` and ``app.extensions``
    name: str = ""
    @property
    def demo(self):
        """The module offering ``make demo`` (``start_model``, ``overlay``, ``seed``,
        ``warning``, ``DATA_SUBDIR``), or None."""
        return None

    def config_section(self) -> ConfigSection | None:
        """Its section of config.yaml (the section's ``name`` is usually the extension's), or
        None when it has none. Called once per config load, before :meth:`enabled`."""
        return None

    def enabled(self, config: Config) -> bool:
        return True

    def families(self, config: Config) -> list[Family]:
        return []

    def model_names(self, config: Config) -> list[str]:
        """Model names its turns may pass to Hermes (``hermes chat -m``) besides
        ``hermes.model.default``: the model pass-through forwards those too
        (:mod:`hermes_service.model_proxy.policy`)."""
        return []

    def init_services(self, services: ServiceObjects) -> None:
        pass

    def init_app(self, app: Flask, services: ServiceObjects) -> None:
        pass

    def init_cli(self, group: click.Group) -> None:
        """Add the extension's commands to ``group``. A command reads the config with
        ``ctx.obj["load_config"](ctx)`` (the config of a command that serves nothing; exits 2
        with ``file:key: problem`` lines), so an extension never imports the command line."""

    def on_serve(self, services: ServiceObjects) -> None:
        pass

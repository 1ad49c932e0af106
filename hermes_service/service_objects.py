"""The shape of the service objects, for the modules that cannot import them.

:class:`~hermes_service.services.Services` is built by :mod:`hermes_service.services`, which
builds the installed extensions too; the request helpers (:mod:`hermes_service.web.helpers`), the
extension seam (:mod:`hermes_service.extensions`) and the extensions themselves are imported
on that way, so naming ``Services`` there would close an import cycle (type-only imports count:
tests/unit/test_layers_imports.py). They name :class:`ServiceObjects` instead: a
:class:`typing.Protocol` of the same public attributes and methods, in a module that imports
nothing at run time (tests/unit/test_layers_imports.py checks ``Services`` has every member
it lists, and it lists every public one of ``Services``).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .config import Config
    from .conversations import Conversations
    from .disk.quota import Disk
    from .homes.users import UserHomes
    from .idempotency import IdempotencyStore
    from .limits import Limiter
    from .model_proxy.proxy import ModelProxy
    from .runner import CliRunner, Processes, RunnerChoice
    from .sandbox import Sandbox
    from .security import Guard
    from .session_store import SessionStore
    from .storage.idempotency import PgIdempotencyStore
    from .storage.node import SharedNode
    from .storage.sessions import PgSessionStore


class ServiceObjects(Protocol):
    """What :class:`hermes_service.services.Services` offers (its docs say what each does)."""
    config: Config
    guard: Guard
    store: SessionStore | PgSessionStore
    homes: UserHomes
    processes: Processes
    runner: CliRunner
    runners: RunnerChoice
    conversations: Conversations
    admitted: Limiter
    sandbox: Sandbox
    disk: Disk
    model_proxy: ModelProxy
    idempotency: IdempotencyStore | PgIdempotencyStore
    service_url: str | None
    shared: SharedNode | None
    extensions: dict
    retention_steps: list
    drain_sources: list
    reloaders: list

    @property
    def draining(self) -> bool: ...

    def require_provider(self) -> None: ...

    def apply(self, config: Config) -> None: ...

    def drain(self) -> None: ...

    def check_accepting(self) -> None: ...

    def in_flight(self) -> dict: ...

    def outcome(self, key) -> str: ...

    def shutdown(self) -> int: ...

    def admission(self, label: str = ...) -> AbstractContextManager[None]: ...

"""Which runner takes a turn (docs/runners.md) — the one place this is decided.

A route family's turns run on the warm ACP runner when the config names it for that family
(:func:`acp_families`), else on the CLI runner; a turn the ACP runner cannot serve (it raises
:class:`~hermes_service.runner.protocol.UseCli`: a CLI-made session, another model, a full
pool, a drain) runs on the CLI runner instead.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import RunError
from .protocol import TurnRequest, TurnResult, UseCli

if TYPE_CHECKING:
    from .acp import AcpRunner
    from .cli import CliRunner

#: its lines keep the logger name they had when the choice was made inside Conversations
log = logging.getLogger("hermes_service.conversations")


def acp_families(families) -> frozenset[str]:
    """The names of the route families (:class:`~hermes_service.extensions.Family`, e.g.
    :func:`hermes_service.installed.route_families`) whose turns run on the warm ACP runner
    (docs/runners.md): ``v1`` when ``hermes.runner: acp`` (default ``cli``: ``hermes chat -q …
    --source tool``, the runner the v1.3.0 API is specified around), an extension's family
    when its config says so."""
    return frozenset(f.name for f in families if f.runner == "acp")


class RunnerChoice:
    """The service's runners and the rule choosing between them (see the module doc).
    ``acp`` is None when no route family uses it (then every turn runs on ``cli``)."""

    def __init__(self, cli: CliRunner, acp: AcpRunner | None = None,
                 families: frozenset[str] = frozenset()):
        self.cli = cli
        self.acp = acp
        #: the route families whose turns go to ``acp`` (:func:`acp_families`)
        self.families = families if acp is not None else frozenset()

    def warm(self, family: str) -> AcpRunner | None:
        """The ACP runner when ``family``'s turns run on it (a process worth pre-warming)."""
        return self.acp if family in self.families else None

    def run_turn(self, req: TurnRequest, clock) -> TurnResult:
        """Run ``req`` on its runner; ``clock.runner`` (a
        :class:`~hermes_service.metrics.TurnClock`) is set to the name of the runner that
        takes it. Raises what that runner raises — a turn that failed because its user's
        token budget ran out during it as ``token_budget_exceeded``
        (:meth:`~hermes_service.runner.processes.Processes.explain`)."""
        try:
            acp = self.acp
            if acp is not None and req.family in self.families:
                clock.runner = acp.name
                try:
                    return acp.run_turn(req)
                except UseCli as why:
                    log.info("turn on the CLI runner (%s) %s", why, req.log_ctx)
            clock.runner = self.cli.name
            return self.cli.run_turn(req)
        except RunError as err:
            better = self.cli.processes.explain(err, req.home)
            if better is err:
                raise
            raise better from None

"""The hand-made mutants of the security- and durability-critical modules, one file per module
group (docs/testing.md §Mutation testing): each a one-line slip a developer could make (a
flipped condition, a removed fsync, a changed pragma, a dropped bind flag, an off-by-one in a
cap, a wrong scheme check …), run against the fast unit tests that should catch it.

``python mutation/run.py --group sandbox`` runs one group; a survivor is listed in
``mutation/survivors.tsv`` as module ``hand:<group>``, function ``-``, its name."""
from __future__ import annotations

from . import (
    approvals,
    bounds,
    disk,
    durability,
    idempotency,
    model_proxy,
    network,
    runners,
    sandbox,
    serving,
)

MUTANTS = [*sandbox.MUTANTS, *model_proxy.MUTANTS, *runners.MUTANTS, *disk.MUTANTS,
           *idempotency.MUTANTS, *durability.MUTANTS, *approvals.MUTANTS,
           *serving.MUTANTS, *network.MUTANTS, *bounds.MUTANTS]

"""The Hermes runners (README §Runners).

* :mod:`.protocol` — a turn: request, result, listener, the answer from Hermes's record;
* :mod:`.failures` — how a failed turn becomes a stable error code;
* :mod:`.processes` — Hermes processes: process groups, killing, the process outcome;
* :mod:`.run_files` — the per-run files the Hermes plugins read;
* :mod:`.cli` — the CLI runner (``hermes chat --query … -Q --source tool``);
* :mod:`.acp` — the warm ACP runner (a pool of ``hermes acp`` processes).
"""
from .acp import AcpRunner
from .cli import HermesRunner
from .failures import classify_failure, classify_text
from .processes import CliProcess, Outcome, ProcessGroups
from .protocol import TurnListener, TurnRequest, TurnResult, UseCli
from .run_files import RunFiles

__all__ = ["AcpRunner", "CliProcess", "HermesRunner", "Outcome", "ProcessGroups", "RunFiles",
           "TurnListener", "TurnRequest", "TurnResult", "UseCli", "classify_failure",
           "classify_text"]

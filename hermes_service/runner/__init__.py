"""The Hermes runners (docs/runners.md).

* :mod:`.protocol` — a turn: request, result, listener, the answer from Hermes's record;
* :mod:`.failures` — how a failed turn becomes a stable error code;
* :mod:`.processes` — Hermes processes: the one owner of the turn slots, the process groups
  and the launcher (both runners, ``execute``, ``/status`` and ``gc`` start Hermes there);
* :mod:`.run_files` — the per-user run folder (a CLI turn's marker);
* :mod:`.cli` — the CLI runner (``hermes chat --query … -Q --source tool``);
* :mod:`.acp` — the warm ACP runner (a pool of ``hermes acp`` processes);
* :mod:`.answer_text` — streamed text that adds up to the recorded answer;
* :mod:`.choice` — which runner takes a turn.
"""
from .acp import AcpRunner
from .choice import RunnerChoice, acp_families
from .cli import CliRunner
from .failures import classify_failure, classify_text
from .processes import CliProcess, Outcome, Processes, ProcessGroups
from .protocol import (
    FINISH_REASON,
    USAGE,
    Questions,
    TurnListener,
    TurnRequest,
    TurnResult,
    UseCli,
)
from .run_files import RunFiles

__all__ = [
    "FINISH_REASON",
    "USAGE",
    "AcpRunner",
    "CliProcess",
    "CliRunner",
    "Outcome",
    "ProcessGroups",
    "Processes",
    "Questions",
    "RunFiles",
    "RunnerChoice",
    "TurnListener",
    "TurnRequest",
    "TurnResult",
    "UseCli",
    "acp_families",
    "classify_failure",
    "classify_text",
]

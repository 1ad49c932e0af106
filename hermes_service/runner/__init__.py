"""The Hermes runners (README §Runners): the CLI runner (:mod:`.cli`) and the warm ACP
runner (:mod:`.acp`)."""
from .acp import AcpRunner
from .cli import (CliProcess, HermesRunner, Outcome, RunFiles, TurnListener, TurnRequest,
                  TurnResult, UseCli, classify_failure, classify_text)

__all__ = ["AcpRunner", "CliProcess", "HermesRunner", "Outcome", "RunFiles", "TurnListener",
           "TurnRequest", "TurnResult", "UseCli", "classify_failure", "classify_text"]

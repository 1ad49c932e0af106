"""Group ``runners``: the per-turn CPU budget and the limits a runner reads
(sandbox/launcher.py ``Launch``), the checks before a turn on both runners
(runner/processes.py, runner/cli.py, runner/acp/runner.py), and a warm process killed and
closed after an abort (runner/acp/)."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="runners")
L = "hermes_service/sandbox/launcher.py"
TURN = "hermes_service/runner/acp/turn.py"
POOL = "hermes_service/runner/acp/pool.py"
PROC = "hermes_service/runner/acp/process.py"
PS = "hermes_service/runner/processes.py"
BUDGET = ["tests/unit/sandbox/test_cpu_budget.py"]
WHOLE = ["tests/unit/sandbox/test_args_whole.py::"
         "test_the_file_size_limit_is_what_is_left_of_the_quota_when_given"]
ACP = "tests/unit/runner/test_acp_rules.py"
ABORT = [f"{ACP}::test_an_aborted_turn_whose_agent_ignores_cancel_kills_its_process"]
MARK = [f"{ACP}::test_every_turn_of_a_warm_process_starts_its_own_cpu_budget"]
QUOTA = ["tests/unit/runner/test_quota_both_runners.py"]

MUTANTS = [
    # -- the CPU budget --------------------------------------------------------------------
    H("the CPU budget is not passed to the sandbox", L,
      "_on_close=on_close, cpu_limit=float(lim.cpu_seconds))", "_on_close=on_close)", WHOLE),
    H("the CPU budget is not reset per turn (counted from the start)", L,
      "if self.cpu_limit is not None and self.cpu_seconds() - self._cpu_start > self.cpu_limit:",
      "if self.cpu_limit is not None and self.cpu_seconds() > self.cpu_limit:", BUDGET),
    H("the CPU budget's edge: exactly the budget is over it", L,
      "if self.cpu_limit is not None and self.cpu_seconds() - self._cpu_start > self.cpu_limit:",
      "if self.cpu_limit is not None and self.cpu_seconds() - self._cpu_start >= self.cpu_limit:",
      BUDGET),
    H("mark() does not move the budget's start", L, "        self._cpu_start = self.cpu_seconds()\n",
      "        self._cpu_start = 0.0\n", BUDGET),
    H("a warm process's turn does not mark its budget", TURN,
      "            proc.launch.mark()        # this turn's CPU budget", "            pass  #", MARK),
    H("cgroup events counted from zero, not the launch", L,
      "                if now[key] > self._baseline.get(key, 0):",
      "                if now[key] > 0:", BUDGET),
    H("the disk watcher's verdict is not reported", L,
      "        if self.over is not None:\n            return self.over\n", "", BUDGET),
    H("a failing cleanup stops the others", L,
      "            try:\n                fn()\n            except Exception:  # cleanup must go on\n"
      "                log.exception(\"sandbox cleanup failed\")\n",
      "            fn()\n", BUDGET),
    H("a closed launch keeps its cgroup", L,
      '            threading.Thread(target=self.cgroup.remove, name="cgroup-remove", daemon=True).start()\n',
      "", BUDGET),
    # -- a warm process after an abort -------------------------------------------------------
    H("an aborted turn's process is left running", TURN,
      "            await self.pool.kill(proc, reason, replace=reason != \"shutdown\")\n", "            pass\n",
      ABORT),
    H("a killed process is not signalled", POOL, "        await proc.kill_async(reason)\n", "", ABORT),
    H("an ACP process that ended keeps its launch open (credential not revoked)", PROC,
      "        self.limit = self.limit or self.launch.limit_hit() or limit_signal(rc)\n"
      "        self.launch.close()\n",
      "        self.limit = self.limit or self.launch.limit_hit() or limit_signal(rc)\n", ABORT),
    # -- the checks before a turn ----------------------------------------------------------
    H("the warm runner skips the checks before a turn", "hermes_service/runner/acp/runner.py",
      "        self.processes.check_turn(req.home)\n", "", QUOTA),
    H("the CLI runner skips the checks before a turn", "hermes_service/runner/cli.py",
      "            self.processes.check_turn(req.home)\n", "", QUOTA),
]

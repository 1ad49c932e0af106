"""Group ``disk``: a home's quota and the disk floor (disk/quota.py) as the launcher and the
watcher apply them."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="disk")
D = "hermes_service/disk/quota.py"
USE = "hermes_service/disk/use.py"
WATCH = "hermes_service/disk/watch.py"
DISK = ["tests/unit/disk/test_quota.py", "-k", "not 507"]
RULES = ["tests/unit/disk/test_quota.py", "tests/unit/disk/test_quota_rules.py", "-k", "not 507"]

MUTANTS = [
    H("the record's reserve is a quarter", D, "return max(4.0, min(256.0, max_home_mb / 8))",
      "return max(4.0, min(256.0, max_home_mb / 4))", RULES),
    H("the run folder is not counted", USE, "return Usage(max(0.0, total - state) + run, state)",
      "return Usage(max(0.0, total - state), state)", RULES),
    H("the record is counted twice", USE, "return Usage(max(0.0, total - state) + run, state)",
      "return Usage(total + run, state)", RULES),
    H("a turn checks the files only, not the whole home", D,
      "        if used.total_mb > self.max_home_mb - QUOTA_HEADROOM_MB:",
      "        if used.files_mb > self.max_home_mb - QUOTA_HEADROOM_MB:", RULES),
    H("a turn starts below the disk floor", D,
      "            if sp is not None and self._is_low(sp):\n                raise storage_error(label)\n",
      "", RULES),
    H("the file size limit ignores what is left of the quota", D,
      "return int(min(float(file_size_mb), left) * MIB)", "return int(float(file_size_mb) * MIB)",
      RULES),
    H("the file size limit may be zero", D,
      "left = max(1.0, self.files_cap_mb - used.files_mb)",
      "left = max(0.0, self.files_cap_mb - used.files_mb)", RULES),
    H("the watcher ignores files past their cap", WATCH,
      "over = w.now.files_mb > rules.files_cap_mb or \\\n",
      "over = False or \\\n", RULES),
    H("the watcher never ends a sandbox over its quota", WATCH,
      "                if over and quota:", "                if False:", DISK),
    H("an ended sandbox is not marked over", WATCH, "        w.launch.over = why\n", "", DISK),
    H("an ended sandbox is not killed", WATCH,
      "            signal_tree(w.launch.pid, signal.SIGKILL)\n", "            pass\n", RULES),
    H("the floor is half of min_free_mb", D, "        if sp.bytes < self.min_free:",
      "        if sp.bytes < self.min_free / 2:", RULES),
    H("below the floor every sandbox that grew a little is ended", WATCH,
      "grown = [w for w in live if w.grown_mb > GROWTH_MB]",
      "grown = [w for w in live if w.grown_mb >= 0]", RULES),
]

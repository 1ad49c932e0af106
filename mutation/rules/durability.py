"""Group ``durability``: the run event logs (mnote/runs/log.py) and a run of another process
(mnote/runs/foreign.py): fsyncs, exactly one terminal event, the follower's pending answers."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="durability")
RL = "hermes_service/mnote/runs/log.py"
FR = "hermes_service/mnote/runs/foreign.py"
RULES = ["tests/unit/mnote/runs/test_log_rules.py"]
LOG = ["tests/unit/mnote/runs/test_log.py", "tests/unit/mnote/runs/test_log_rules.py"]
FULL = ["tests/unit/mnote/runs/test_log_full_disk.py"]

MUTANTS = [
    H("the terminal event is not fsynced", RL,
      "            if durable:\n                os.fsync(self.fd)\n", "", RULES),
    H("the writer stays open after the terminal event", RL,
      "        if durable:\n            self.close()\n", "", RULES),
    H("the meta line is not fsynced", RL, "            writer.append({\"meta\": meta})\n            os.fsync(fd)\n",
      "            writer.append({\"meta\": meta})\n", RULES),
    H("the run's folder is not fsynced at create", RL,
      "            os.fsync(fd)\n            self._fsync_dir()\n", "            os.fsync(fd)\n", RULES),
    H("the interrupted close is not fsynced", RL,
      '                                  "error": INTERRUPTED_DETAIL})\n            os.fsync(fd)\n',
      '                                  "error": INTERRUPTED_DETAIL})\n', RULES),
    H("the interrupted close takes no lock", RL, "            fcntl.flock(fd, fcntl.LOCK_EX)\n", "",
      RULES),
    H("a second terminal event is written", RL,
      "            if events and events[-1].get(\"event\") in TERMINAL:\n                return False\n",
      "", RULES),
    H("a live owner's run is closed", RL,
      "            if instance.alive(meta.get(\"owner\")):\n                return False\n", "", RULES),
    H("run.cancelled is not terminal", RL,
      'TERMINAL = ("run.completed", "run.failed", "run.cancelled")',
      'TERMINAL = ("run.completed", "run.failed")', RULES),
    H("a torn last line is kept", RL,
      "            if end < len(data):        # a torn line: the owner died writing it\n"
      "                os.ftruncate(fd, end)\n", "", LOG),
    H("a line cut by a full disk stays", RL,
      "            try:\n                os.ftruncate(self.fd, start)\n            except OSError:\n                pass\n",
      "            pass\n", FULL),
    H("the last answer wins (replace, not link)", RL, "            os.link(tmp, path)\n",
      "            os.replace(tmp, path)\n", RULES),
    H("an answer's claim is not fsynced", RL,
      "            os.write(fd, _line(answer))\n            os.fsync(fd)\n",
      "            os.write(fd, _line(answer))\n", RULES),
    H("an answer's folder is not fsynced", RL,
      "            os.link(tmp, path)\n            self._fsync_dir()\n", "            os.link(tmp, path)\n",
      RULES),
    H("another process's live run does not hold the session", RL,
      "                    elif instance.alive(head[0].get(\"owner\")):\n                        return current\n",
      "", LOG),
    H("close_dead closes runs of live owners", RL,
      "            if head is None or head[1] or instance.alive(head[0].get(\"owner\")):",
      "            if head is None or head[1]:", LOG),
    # -- a run of another process --------------------------------------------------------
    H("a followed run that ended keeps its questions pending", FR,
      "        if self.done:\n            return {}\n        pending = {}",
      "        pending = {}", RULES),
    H("an answered question of a followed run stays pending", FR,
      '            elif name == "approval.responded":\n                pending.pop(e.get("approval_id"), None)\n',
      "", RULES),
    H("a followed run's answer is not claimed", FR,
      '        if self._logs.claim(self.run_id, question_id, {"value": value, "resolved_by": "user"}):\n'
      "            raise not_pending(question_id, kind)\n", "", RULES),
    H("a followed run's choice is not checked", FR,
      "        if choice not in choices:\n            raise BadRequest(",
      "        if False:\n            raise BadRequest(", RULES),
    H("an orphaned followed run is never closed", FR,
      "        if not self.done and not instance.alive(self.owner):",
      "        if False:", LOG),
]

"""Group ``approvals``: a run's questions to its user and the one answer across processes
(mnote/runs/questions.py, RunLogs.claim)."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="approvals")
Q = "hermes_service/mnote/runs/questions.py"
QT = ["tests/unit/mnote/runs/test_questions.py", "tests/unit/mnote/runs/test_questions_rules.py"]
RULES = [*QT, "tests/unit/mnote/runs/test_log_rules.py"]

MUTANTS = [
    H("any choice is accepted", Q, "            if choice not in choices:\n",
      "            if False:\n", QT),
    H("an approval id answers a clarify question (and back)", Q,
      "        if question is None or question.kind != kind:", "        if question is None:", QT),
    H("a question is asked after the abort", Q,
      "        with self.run.lock:\n            if self.run.done or self.run.cancel.is_set():\n"
      "                return None\n            question = Question(",
      "        with self.run.lock:\n            if self.run.done:\n                return None\n"
      "            question = Question(", QT),
    H("a clarify question is asked after the run ended", Q,
      "            if self.run.done or self.run.cancel.is_set():\n                return None\n"
      "            asked = Question(",
      "            if self.run.cancel.is_set():\n                return None\n            asked = Question(", QT),
    H("the answer another process won is ignored (both applied)", Q,
      "        if won is not None:\n", "        if False:\n", RULES),
    H("the answer is never claimed across processes", Q,
      "        won = None if claimed else self._claim(question.question_id, value, resolved_by)",
      "        won = None", RULES),
    H("a won answer that is not a choice is applied as is", Q,
      'lambda won: won if won in choices else "deny")', "lambda won: won)", QT),
    H("an answered question stays pending", Q, "        del self.pending[question.question_id]\n",
      "        self.pending.get(question.question_id)\n", QT),
    H("question ids are guessable", Q, 'Question("apr_" + secrets.token_hex(12), list(choices))',
      'Question("apr_" + "0" * 24, list(choices))', QT),
    H("the responded event names no resolver", Q,
      "            self.run.emit(\"approval.responded\", approval_id=question.question_id, choice=value,\n"
      "                          resolved_by=resolved_by)",
      "            self.run.emit(\"approval.responded\", approval_id=question.question_id, choice=value,\n"
      "                          resolved_by=\"user\")", QT),
]

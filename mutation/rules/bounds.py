"""Group ``bounds``: what a sandbox's output may cost or reach, checked by what each rule is
for — the import hook's guard of a Hermes process (hermes_site/sitecustomize.py), the kernel
adapter's answer cap (mnote/kernel/over_http.py), a state.db read's deadline
(homes/state_db.py), the room kept for a run's end (mnote/event_bounds.py), a body's cost
(model_proxy/body_check.py), the budget reservation (model_proxy/policy.py, proxy.py), a
question after abort (mnote/runs/questions.py), and the sandbox's arguments read as mounts
and namespaces (tests/unit/sandbox/test_args_meaning.py, not the copied list)."""
from __future__ import annotations

from functools import partial

from mutation.hand_mutants import Hand

H = partial(Hand, group="bounds")
SITE = "hermes_service/hermes_site/sitecustomize.py"
GUARD = ["tests/unit/hermes_site/test_guard.py"]
MEANING = ["tests/unit/sandbox/test_args_meaning.py"]
LAUNCHER = "hermes_service/sandbox/launcher.py"
BODY = ["tests/unit/model_proxy/test_body_check.py"]
RESERVE = ["tests/unit/model_proxy/test_reservation.py"]

MUTANTS = [
    H("a Hermes process stays dumpable", SITE,
      "    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:", "    if False:", GUARD),
    H("fds 0-2 stay on the service's pipes", SITE, "        os.dup2(null, fd)\n",
      "        pass\n", GUARD),
    H("a child given sys.stdout gets the service's pipe", SITE,
      "    _no_private_stdio_for_children(private)\n", "    pass\n", GUARD),
    H("the guard's variable reaches Hermes's children", SITE,
      "    if os.environ.pop(GUARD_ENV, None) != \"1\":",
      "    if os.environ.get(GUARD_ENV, None) != \"1\":", GUARD),
    H("a chunked kernel answer is read whole", "hermes_service/mnote/kernel/over_http.py",
      "        data = resp.read(MAX_ANSWER_BYTES + 1)", "        data = resp.read()",
      ["tests/unit/mnote/kernel/test_over_http.py", "-k", "anything_but"]),
    H("state.db statements run without a deadline", "hermes_service/homes/state_db.py",
      "    conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)",
      "    pass", ["tests/unit/homes/test_state_db.py", "-k", "deadline"]),
    H("no room is kept for a run's end", "hermes_service/mnote/event_bounds.py",
      "TERMINAL_RESERVE = 2 * 1024 * 1024", "TERMINAL_RESERVE = 0",
      ["tests/unit/mnote/test_event_bounds.py"]),
    H("a small body of very many values is parsed in the service",
      "hermes_service/model_proxy/body_check.py",
      "        if values is not None and values <= limits.INLINE_VALUES:",
      "        if values is not None:", BODY),
    H("one user may hold every parse worker", "hermes_service/model_proxy/body_check.py",
      "            while self._busy >= limits.PARSES or user in self._busy_users:",
      "            while self._busy >= limits.PARSES:", BODY),
    H("max_completion_tokens is ignored by the reservation", "hermes_service/model_proxy/policy.py",
      'obj.get("max_completion_tokens") or obj.get("max_tokens"))', 'obj.get("max_tokens"))',
      RESERVE),
    H("a request naming no output reserves nothing", "hermes_service/model_proxy/proxy.py",
      "(prepared.max_output or limits.RESERVE_OUTPUT_TOKENS)", "(prepared.max_output or 0)",
      RESERVE),
    H("a clarify question is asked after the abort", "hermes_service/mnote/runs/questions.py",
      "            if self.run.done or self.run.cancel.is_set():\n                return None\n"
      "            asked = Question(",
      "            if self.run.done:\n                return None\n            asked = Question(",
      ["tests/unit/mnote/runs/test_questions.py"]),
    H("the Hermes venv is bound read-write", LAUNCHER,
      'bargs += ["--ro-bind", root, root]', 'bargs += ["--bind", root, root]', MEANING),
    H("/dev is left writable", LAUNCHER,
      '"--tmpfs", "/dev/shm", "--remount-ro", "/dev",', '"--tmpfs", "/dev/shm",', MEANING),
    H("IPC is shared with the host", "hermes_service/sandbox/args.py",
      '"--unshare-pid", "--unshare-ipc", "--unshare-uts",', '"--unshare-pid", "--unshare-uts",',
      MEANING),
    H("processes unlimited without a cgroup", LAUNCHER,
      'rlimits += [f"--nproc={lim.processes}", ', "rlimits += [", MEANING),
]

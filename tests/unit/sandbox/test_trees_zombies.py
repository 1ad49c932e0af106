"""Zombies in a sandbox's process tree (:func:`hermes_service.sandbox.zombies`) and the count
at which a warm process is retired (:func:`hermes_service.runner.acp.turn.zombie_limit`).
That the retirement happens is seen end to end (tests/e2e/test_e2e_sandbox.py,
test_nothing_a_warm_turn_started_outlives_it)."""
from __future__ import annotations

import os
import signal
import subprocess

from hermes_service.runner.acp.turn import zombie_limit
from hermes_service.sandbox import zombies
from support.fixtures import wait_for


def test_zombies_counts_the_unreaped_children_under_the_leaders_command():
    # leader (sh) -> its command (sh, then exec'd into sleep, which never reaps) -> 3 ended
    leader = subprocess.Popen(["sh", "-c", "sh -c 'true & true & true & exec sleep 30'; :"],
                              start_new_session=True)
    try:
        wait_for(lambda: zombies(leader.pid) == 3, "three zombies under the command", 10)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_no_tree_no_zombies():
    assert zombies(2 ** 22 + 7) == 0


def test_zombie_limit_is_a_quarter_of_the_process_limit_and_at_least_8():
    assert zombie_limit(256) == 64 and zombie_limit(64) == 16
    assert zombie_limit(32) == 8 and zombie_limit(8) == 8

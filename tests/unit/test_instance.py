"""Owner ids of service processes (hermes_service/instance.py)."""
import subprocess
import sys

from hermes_service import instance


def test_current_names_this_process_and_is_alive():
    me = instance.current()
    assert me.split("-")[0].isdigit() and instance.alive(me)


def test_a_dead_process_or_a_reused_pid_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = instance.proc_start(child.pid)
    child.wait()
    assert not instance.alive(f"{child.pid}-{start}")
    pid, _, start = instance.current().partition("-")
    assert not instance.alive(f"{pid}-{int(start) + 1}")      # same pid, other process


def test_malformed_owner_ids_are_not_alive():
    for owner in (None, "", "123", "abc-def", "-5", f"{instance.current().split('-')[0]}-None"):
        assert not instance.alive(owner)

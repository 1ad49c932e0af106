"""The import hook's guard of a Hermes process (hermes_service/hermes_site/sitecustomize.py;
docs/sandbox.md §What a tool process cannot reach), in a real Python process (the hook is
standard library only; this test's own interpreter, so it runs where Hermes is stubbed): the
process is non-dumpable; fds 0-2 hold ``/dev/null`` and its own output goes to private
close-on-exec descriptors, so a child — inherited streams or ``stdout=sys.stdout`` given
explicitly — never holds the service's pipes; the guard's variable never reaches a child.
Without ``HERMES_SERVICE_GUARD=1`` nothing of this happens (the premise)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_service.homes.users import HERMES_SITE

PROBE = r"""
import ctypes, json, os, subprocess, sys
libc = ctypes.CDLL(None)
child = subprocess.Popen(["/bin/sh", "-c", "echo $$ >&2; exec sleep 120"])
given = subprocess.Popen(["/bin/sh", "-c", "exec sleep 120"], stdout=sys.stdout,
                         stderr=sys.stderr)
env = subprocess.run(["env"], capture_output=True, text=True).stdout
fds = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)}
kids = {name: {fd: os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in (0, 1, 2)}
        for name, p in (("inherited", child), ("given", given))}
print(json.dumps({"dumpable": libc.prctl(3, 0, 0, 0, 0), "fds": fds, "kids": kids,
                  "pids": [child.pid, given.pid],
                  "guard_in_child": "HERMES_SERVICE_GUARD" in env}), flush=True)
"""


def _run(tmp_path: Path, guard: bool) -> dict:
    python = sys.executable
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERMES_SITE),
           **({"HERMES_SERVICE_GUARD": "1"} if guard else {})}
    proc = subprocess.Popen([python, "-c", PROBE], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.PIPE, cwd=tmp_path)
    try:
        if guard:
            # the guarded process's children hold nothing of the pipe: EOF once it exits
            # while they still sleep (a child holding it would time this out)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail("a child of the guarded process holds the service's pipe")
            got = json.loads(out.decode().strip().splitlines()[-1])
        else:
            got = json.loads(proc.stdout.readline())
            for pid in got["pids"]:
                os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in got["pids"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return got


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("guarded"), guard=True)


def test_a_guarded_process_is_not_dumpable(guarded, tmp_path):
    assert guarded["dumpable"] == 0
    assert _run(tmp_path, guard=False)["dumpable"] == 1          # the premise


def test_fds_0_to_2_hold_dev_null_and_children_never_get_the_pipes(guarded):
    assert set(guarded["fds"].values()) == {"/dev/null"}
    for name, fds in guarded["kids"].items():
        assert set(fds.values()) == {"/dev/null"}, name


def test_without_the_guard_a_child_would_hold_the_services_pipe(tmp_path):
    got = _run(tmp_path, guard=False)
    assert got["fds"]["1"].startswith("pipe:")
    assert got["kids"]["inherited"]["1"].startswith("pipe:")


def test_the_guards_variable_never_reaches_a_child(guarded):
    assert guarded["guard_in_child"] is False

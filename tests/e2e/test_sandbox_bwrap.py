"""The sandbox for real: launches through bubblewrap, and a served /health saying when auto
mode found none (the checks and the launch plan: tests/unit/sandbox/test_launcher.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from hermes_service import sandbox
from hermes_service.homes.users import HERMES_SITE, UserHome
from hermes_service.sandbox import hermes_policy
from support.fixtures import ROOT
from unit.sandbox.test_launcher import NO_BWRAP, cfg


@pytest.mark.sandbox
def test_auto_with_bubblewrap_allows_the_coding_toolsets_without_a_warning(tmp_path):
    config = cfg(tmp_path, toolsets=["terminal", "file", "code_execution"])
    # (a service running as root is told so, as the tests here are: not about the toolsets)
    assert not [w for w in config.warnings if "sandbox" in w and "runs as root" not in w]


@pytest.mark.sandbox
def test_a_prepared_launch_hides_host_paths_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVICE_SECRET", "do-not-leak-9c1")
    monkeypatch.setattr(hermes_policy, "HERMES_ARGS", ())   # the command is a shell, not Hermes
    home = UserHome("alice", tmp_path / "users" / "alice", tmp_path / "users" / "alice" / ".hermes")
    home.hermes_home.mkdir(parents=True)
    run_dir = tmp_path / "runs" / "alice"
    run_dir.mkdir(parents=True)
    box = sandbox.Sandbox(sandbox.Settings(mode="bwrap"), tmp_path, HERMES_SITE)
    env = {"HOME": str(home.root), "HERMES_HOME": str(home.hermes_home), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(HERMES_SITE), "MNOTE_RUN_DIR": str(run_dir)}
    launch = box.prepare(["-c", "cat /proc/1/cmdline; echo; cat /proc/1/environ; echo; pwd"],
                         env, home, run_dir, "/bin/sh")
    try:
        assert launch.sandboxed and str(tmp_path) not in " ".join(launch.argv)
        assert launch.env["HOME"] == sandbox.HOME and launch.env["MNOTE_RUN_DIR"] == sandbox.RUN_DIR
        out = subprocess.run(launch.argv, env=launch.env, cwd=launch.cwd, pass_fds=launch.pass_fds,
                             capture_output=True, timeout=30)
    finally:
        launch.close()
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode(errors="replace")
    assert str(tmp_path) not in text and "/home/hermes" in text    # /proc/1: the command
    assert "do-not-leak-9c1" not in text and "HERMES_HOME=/home/hermes/.hermes" in text


def test_health_and_check_config_say_when_auto_found_no_sandbox(start_service, tmp_path):
    svc = start_service({"hermes": {"sandbox": {"bwrap": NO_BWRAP}}})
    res = svc.get("/health")
    assert res.status_code == 200 and res.json()["status"] == "degraded", res.text
    assert "unconfined" in res.json()["checks"]["sandbox"]
    svc.wait_log("auto found no usable sandbox")
    path = tmp_path / "cc.yaml"
    path.write_text(yaml.safe_dump(svc.cfg))
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(path),
                          "check-config"], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "warning: " in out.stderr and "auto found no usable sandbox" in out.stderr
    assert "sandbox: auto -> unconfined" in out.stdout


@pytest.mark.sandbox
def test_a_runtime_under_tmp_is_still_visible_over_the_private_tmp(tmp_path):
    """A checkout (and so the Hermes venv) under /tmp: the sandbox's own /tmp must not hide it."""
    assert str(tmp_path).startswith("/tmp/")
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    cmd = bindir / "fake-hermes"
    cmd.write_text("#!/bin/sh\necho ran-inside\n")
    cmd.chmod(0o755)
    home = UserHome("u", tmp_path / "users" / "u", tmp_path / "users" / "u" / ".hermes")
    home.hermes_home.mkdir(parents=True)
    box = sandbox.Sandbox(sandbox.Settings(mode="bwrap"), tmp_path, HERMES_SITE)
    launch = box.prepare([], {"PATH": "/usr/bin:/bin"}, home, None, str(cmd))
    try:
        out = subprocess.run(launch.argv, env=launch.env, cwd=launch.cwd, pass_fds=launch.pass_fds,
                             capture_output=True, timeout=30)
    finally:
        launch.close()
    assert out.returncode == 0 and b"ran-inside" in out.stdout, out.stderr

"""deploy/systemd/hermes-service.service: the unit verifies, carries the sandbox
docs/sandbox.md promises, and its ExecStart line (with this checkout's paths) serves and stops cleanly."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
import yaml

from support.fixtures import API_KEY, PROVIDER_KEY_ENV, ROOT, base_config, free_port

UNIT = ROOT / "deploy" / "systemd" / "hermes-service.service"
INSTALL_DIR = "/opt/hermes-service"
CONFIG = "/etc/hermes-service/config.yaml"


def rendered(tmp_path: Path, config_path: Path | None = None) -> Path:
    """The unit with this checkout in place of /opt/hermes-service (and a test config)."""
    text = UNIT.read_text()
    assert INSTALL_DIR in text and CONFIG in text
    text = text.replace(INSTALL_DIR, str(ROOT)).replace(CONFIG, str(config_path or CONFIG))
    out = tmp_path / UNIT.name
    out.write_text(text)
    return out


def service_section() -> dict[str, list[str]]:
    """[Service] keys → every value given (systemd allows repeats; Environment= does)."""
    values: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def test_the_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd): "
                    "the unit was not verified")
    unit = rendered(tmp_path)
    res = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [l for l in (res.stdout + res.stderr).splitlines() if UNIT.name in l]
    assert res.returncode == 0 and not problems, res.stdout + res.stderr


def test_the_unit_carries_the_promised_sandbox_and_lifecycle():
    s = service_section()
    one = {k: v[-1] for k, v in s.items()}
    assert one["User"] == "hermes" and one["NoNewPrivileges"] == "yes"
    assert one["ProtectSystem"] == "strict" and one["StateDirectory"] == "hermes-service"
    assert one["PrivateTmp"] == "yes" and one["ProtectHome"] == "yes"
    assert one["Restart"] == "on-failure" and one["KillSignal"] == "SIGTERM"
    assert one["KillMode"] == "mixed"                   # the service kills its own CLI groups
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    # the sandbox of every Hermes process: a delegated cgroup, the namespaces bwrap needs
    assert one["Delegate"] == "yes" and one["ProtectControlGroups"] == "no"
    assert set(one["RestrictNamespaces"].split()) == {"user", "pid", "ipc", "uts", "mnt", "cgroup"}
    assert set(one["SuccessExitStatus"].split()) == {"130", "143"}
    assert {"2", "3"} <= set(one["RestartPreventExitStatus"].split())
    env = dict(e.split("=", 1) for e in s["Environment"])
    assert env["HERMES_SERVICE_CONFIG"] == CONFIG
    assert env["PATH"].split(":")[0] == f"{INSTALL_DIR}/.hermes-venv/bin"


def test_stop_timeout_outlasts_the_drain():
    """systemd must not kill the service mid-drain (docs/operations.md §Process lifetime): TimeoutStopSec
    exceeds config.yaml's service.drain_seconds (and the code's default) with room for the stop."""
    from hermes_service.config import DEFAULTS
    timeout = service_section()["TimeoutStopSec"][-1]
    assert timeout.isdigit(), f"TimeoutStopSec={timeout}: seconds, as a plain number"
    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())["service"]["drain_seconds"]
    assert shipped == DEFAULTS["service"]["drain_seconds"]
    assert int(timeout) >= shipped + 15, (timeout, shipped)


def test_exec_start_serves_and_a_sigterm_stops_it_cleanly(tmp_path, model):
    """What systemd would run: ExecStart with the unit's environment (paths of this checkout)."""
    port = free_port()
    cfg = base_config(tmp_path, model.base_url)
    cfg["service"]["port"] = port
    cfg["hermes"]["command"] = "hermes"                 # found on the unit's PATH
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    unit = rendered(tmp_path, config_path)
    lines = [l.strip() for l in unit.read_text().splitlines()]
    env = dict(l.split("=", 1)[1].split("=", 1) for l in lines if l.startswith("Environment="))
    env.update({PROVIDER_KEY_ENV: "sk-scripted", "LANG": "C.UTF-8"})
    workdir = next(l.split("=", 1)[1] for l in lines if l.startswith("WorkingDirectory="))
    argv = shlex.split(next(l.split("=", 1)[1] for l in lines if l.startswith("ExecStart=")))
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                res = requests.get(f"http://127.0.0.1:{port}/api/v1/status",
                                   headers={"X-API-Key": API_KEY}, timeout=30)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, "the service did not start"
                time.sleep(0.1)
        assert res.status_code == 200 and res.json()["version"].startswith("Hermes Agent")
        os.kill(proc.pid, signal.SIGTERM)               # KillSignal=SIGTERM, KillMode=mixed
        rc = proc.wait(20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    successes = service_section()["SuccessExitStatus"][-1].split()
    assert rc == 0 or str(rc) in successes, rc


def test_the_rolling_restart_drop_in_only_adds_the_port():
    """hermes-service@.service = this unit + the drop-in: the same command, ``--port %i``."""
    drop_in = ROOT / "deploy" / "systemd" / "hermes-service@.service.d" / "port.conf"
    lines = [l for l in drop_in.read_text().splitlines() if l and not l.startswith("#")]
    assert lines == ["[Service]", "ExecStart=",
                     f"ExecStart={service_section()['ExecStart'][0]} --port %i"]

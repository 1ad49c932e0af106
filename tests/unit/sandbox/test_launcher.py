"""The launcher's rules (hermes_service/sandbox/; docs/sandbox.md): which
configurations are refused or warned about, what a sandboxed process is given, and the
start-up refusal of a real ``main.py`` — no Hermes turn needed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml

from hermes_service import sandbox
from hermes_service.config import ConfigError
from hermes_service.disk import use as disk_use
from hermes_service.installed import build_config
from support.fixtures import ROOT, base_config, deep_merge

NO_BWRAP = "/nonexistent/bwrap"


def cfg(tmp_path, **hermes):
    return build_config(deep_merge(base_config(tmp_path), {"hermes": hermes}))


def problems_of(tmp_path, **hermes) -> list[str]:
    try:
        cfg(tmp_path, **hermes)
    except ConfigError as exc:
        return exc.problems
    return []


def test_none_refuses_host_toolsets_unless_allowed(tmp_path):
    [line] = problems_of(tmp_path, toolsets=["terminal", "web"], sandbox={"mode": "none"})
    assert "hermes.toolsets: terminal reach the host" in line
    assert "hermes.sandbox.allow_host_tools" in line and "hermes.sandbox.mode is none" in line
    assert problems_of(tmp_path, toolsets=["terminal"],
                       sandbox={"mode": "none", "allow_host_tools": True}) == []
    assert problems_of(tmp_path, toolsets=["web"], sandbox={"mode": "none"}) == []


@pytest.mark.parametrize("toolset", ["file", "code_execution", "browser", "delegation",
                                     "cronjob", "computer_use", "coding", "hermes-cli",
                                     "hermes-telegram"])
def test_every_host_reaching_toolset_needs_the_sandbox(tmp_path, toolset):
    assert problems_of(tmp_path, toolsets=[toolset], sandbox={"mode": "none"})


def test_bwrap_mode_on_a_host_without_bubblewrap_is_a_problem_naming_the_package(tmp_path):
    [line] = problems_of(tmp_path, sandbox={"mode": "bwrap", "bwrap": NO_BWRAP})
    assert "hermes.sandbox.mode: bwrap" in line
    assert "bubblewrap" in line and "apt-get install bubblewrap" in line


def test_auto_without_bubblewrap_warns_and_leaves_host_toolsets_out(tmp_path):
    config = cfg(tmp_path, toolsets=["terminal", "web", "hermes-cli", "todo"],
                 sandbox={"mode": "auto", "bwrap": NO_BWRAP})
    [warning] = [w for w in config.warnings if "auto found" in w]
    assert "auto found no usable sandbox" in warning and "unconfined" in warning
    assert "no toolset that reaches the host is offered" in warning
    launcher = sandbox.Sandbox(config.hermes.sandbox, tmp_path, tmp_path)
    assert not launcher.active
    assert launcher.allowed_toolsets(config.hermes.toolsets) == ["web", "todo"]
    # the shipped coding toolsets are no problem there: they are left out, and said so
    assert problems_of(tmp_path, toolsets=["terminal"], sandbox={"bwrap": NO_BWRAP}) == []


@pytest.mark.sandbox
def test_a_working_sandbox_keeps_every_toolset(tmp_path):
    launcher = sandbox.Sandbox(sandbox.Settings(), tmp_path, tmp_path)
    assert launcher.allowed_toolsets(["terminal", "file"]) == ["terminal", "file"]


@pytest.mark.sandbox
def test_the_hosts_network_needs_its_own_allow_key_for_host_toolsets(tmp_path):
    [line] = problems_of(tmp_path, toolsets=["terminal"], sandbox={"network": "host"})
    assert "hermes.sandbox.network: host" in line and "allow_host_network" in line
    assert problems_of(tmp_path, toolsets=["terminal"],
                       sandbox={"network": "host", "allow_host_network": True}) == []
    assert problems_of(tmp_path, toolsets=["todo"], sandbox={"network": "host"}) == []


@pytest.mark.parametrize("entry", ["*", "a b", "x.com:99999", "[::1"])
def test_an_egress_entry_the_policy_cannot_read_is_a_problem(tmp_path, entry):
    [line] = problems_of(tmp_path, sandbox={"egress": {"deny": [entry]}})
    assert line.startswith("<dict>:hermes.sandbox.egress.deny:") and repr(entry) in line


def test_the_limits_have_floors_that_let_a_turn_through(tmp_path):
    lines = problems_of(tmp_path, sandbox={"limits": {"memory_mb": 16, "processes": 2}})
    assert any("limits.memory_mb" in p for p in lines) and any("limits.processes" in p
                                                               for p in lines)


def test_paths_in_the_environment_are_mapped_to_the_sandbox():
    mapping = [("/data/runs/alice", sandbox.RUN_DIR), ("/data/users/alice", sandbox.HOME),
               ("/srv/site", sandbox.SITE_DIR)]
    assert sandbox.map_paths("/data/users/alice/.hermes", mapping) == "/home/hermes/.hermes"
    assert sandbox.map_paths("/srv/site:/opt/x", mapping) == f"{sandbox.SITE_DIR}:/opt/x"
    assert sandbox.map_paths("/data/users/alice2", mapping) == "/data/users/alice2"
    assert sandbox.map_paths("/data/runs/alice/t.turn", mapping) == f"{sandbox.RUN_DIR}/t.turn"


def test_limit_signals_are_read_from_exit_statuses():
    assert sandbox.limit_signal(-signal.SIGXCPU) == "cpu"
    assert sandbox.limit_signal(128 + signal.SIGXFSZ) == "file_size"
    assert sandbox.limit_signal(0) is None and sandbox.limit_signal(1) is None
    assert sandbox.limit_signal(-signal.SIGTERM) is None and sandbox.limit_signal(None) is None


def test_home_size_counts_blocks_once_and_never_follows_symlinks(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 3 * 1024 * 1024)
    os.link(tmp_path / "a.bin", tmp_path / "b.bin")
    big = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    big.write_bytes(b"y" * 8 * 1024 * 1024)
    (tmp_path / "link").symlink_to(big)
    try:
        size = disk_use.home_size_mb(tmp_path)
        assert 2.9 < size < 4, size
        assert disk_use.home_size_mb(tmp_path, stop_above=1) > 1
    finally:
        big.unlink()


def test_the_tool_result_of_a_command_killed_by_an_rlimit_names_it():
    from hermes_service.homes.hermes_state import _tool_limit
    assert _tool_limit('{"output": "", "exit_code": 153, "error": null}') == "file_size"
    assert _tool_limit('{"output": "x", "exit_code": 152}') == "cpu"
    assert _tool_limit('{"output": "bash: line 1: File size limit exceeded"}') == "file_size"
    assert _tool_limit('{"output": "fine", "exit_code": 0}') is None
    assert _tool_limit(None) is None


def _serve(tmp_path, cfg: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=60)


def test_the_service_refuses_to_start_with_terminal_and_no_sandbox(tmp_path):
    out = _serve(tmp_path, deep_merge(base_config(tmp_path), {"hermes": {
        "toolsets": ["terminal"], "sandbox": {"mode": "none"}}}))
    assert out.returncode == 2, out.stderr
    assert "hermes.toolsets: terminal reach the host" in out.stderr
    assert "hermes.sandbox.allow_host_tools" in out.stderr


def test_the_service_refuses_to_start_in_bwrap_mode_without_bubblewrap(tmp_path):
    out = _serve(tmp_path, deep_merge(base_config(tmp_path), {"hermes": {
        "sandbox": {"mode": "bwrap", "bwrap": NO_BWRAP}}}))
    assert out.returncode == 2, out.stderr
    assert "hermes.sandbox.mode: bwrap, but bubblewrap" in out.stderr


def test_a_delegated_cgroup_v2_subtree_gets_a_service_leaf_and_a_cgroup_per_sandbox(tmp_path):
    """cgroup v2 delegation (systemd ``Delegate=yes``), on a stand-in of the cgroup files:
    the service moves itself into a ``service`` leaf (no process may sit in a cgroup whose
    children use controllers), enables memory and pids for its children, and gives each
    sandbox a cgroup with ``memory.max``/``pids.max`` and counters read from ``*.events``."""
    own = tmp_path / "hermes-service.service"
    own.mkdir()
    (own / "cgroup.controllers").write_text("cpu memory pids io\n")
    (own / "cgroup.subtree_control").write_text("\n")
    (own / "cgroup.procs").write_text("4242\n")
    base = sandbox.CgroupBase._v2(own)
    assert base is not None and base.kind == "v2"
    assert (own / "service" / "cgroup.procs").read_text() == "4242"
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"
    cg = base.create(sandbox.Limits(memory_mb=512, processes=64))
    [made] = cg.made
    assert (made / "memory.max").read_text() == str(512 * 1024 * 1024)
    assert (made / "pids.max").read_text() == "64" and (made / "memory.oom.group").read_text() == "1"
    assert cg.procs_files == [str(made / "cgroup.procs")]
    (made / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (made / "pids.events").write_text("max 0\n")
    assert cg.events() == {"memory": 1, "processes": 0}
    (made / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    assert cg.cpu_seconds() == 2.5


def test_a_cgroup_v2_subtree_without_the_controllers_is_not_used(tmp_path):
    own = tmp_path / "cg"
    own.mkdir()
    (own / "cgroup.controllers").write_text("cpu io\n")
    assert sandbox.CgroupBase._v2(own) is None


def test_home_size_counts_every_entry_and_paths_too_long_to_name(tmp_path):
    for i in range(1000):
        (tmp_path / f"f{i}").touch()
    assert disk_use.home_size_mb(tmp_path) >= 1000 * disk_use.MIN_ENTRY_BYTES / 1024 / 1024
    deep = tmp_path / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    try:
        for _ in range(30):                      # > PATH_MAX (4096) below tmp_path
            os.mkdir("d" * 200, dir_fd=fd)
            nxt = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        big = os.open("big.bin", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
        os.write(big, b"z" * 5 * 1024 * 1024)
        os.close(big)
    finally:
        os.close(fd)
    assert disk_use.home_size_mb(tmp_path) > 8.5
    import shutil
    shutil.rmtree(deep)

"""The sandbox's arguments by what they are for (docs/sandbox.md §How a sandbox is built,
§Limits): the list the launcher builds, read back as the mounts, namespaces and limits
bubblewrap makes of it (tests/support/bwrap_view.py) — which paths a Hermes process can
write, which namespaces it has of its own, which limits hold without a cgroup. Unlike the
comparison with a copy (test_args.py), a slip here fails whatever else was changed with it."""
from __future__ import annotations

import os

import pytest

from hermes_service import sandbox
from hermes_service.homes.users import HERMES_SITE, UserHome
from hermes_service.sandbox import args as sandbox_args
from hermes_service.sandbox import hermes_policy
from hermes_service.sandbox.args import HOME, RUN_DIR, SITE_DIR
from support.bwrap_view import read

VENV = "/opt/venv"
PY = f"{VENV}/bin/hermes"
#: the only places a Hermes process may write (docs/sandbox.md §What a tool process cannot reach)
WRITABLE = {HOME, f"{HOME}/.hermes", RUN_DIR, "/tmp", "/dev/shm"}


def _launch(tmp_path, monkeypatch, *, network="isolated", cgroups=None, run=True):
    monkeypatch.setattr(sandbox_args, "runtime_roots", lambda command: (VENV,))
    root = tmp_path / "users" / "alice"
    (root / ".hermes" / "plugins").mkdir(parents=True)
    (root / ".hermes" / "config.yaml").write_text("approvals: {mode: manual}\n")
    run_dir = tmp_path / "runs" / "alice"
    run_dir.mkdir(parents=True)
    sb = sandbox.Sandbox(sandbox.Settings(mode="none", network=network), tmp_path, HERMES_SITE)
    sb.probe = sandbox.Probe("/usr/bin/bwrap", None, None, "")
    sb.active, sb.cgroups = True, cgroups
    made = sb.prepare(["acp"], {"HOME": str(root), "HERMES_HOME": str(root / ".hermes")},
                      UserHome("alice", root, root / ".hermes"), run_dir if run else None, PY)
    args = os.pread(made.pass_fds[0], 1 << 20, 0).decode().split("\0")[:-1]
    return made, read(args), root, run_dir


@pytest.fixture
def launched(tmp_path, monkeypatch):
    made, view, root, run_dir = _launch(tmp_path, monkeypatch)
    yield made, view, root, run_dir
    made.close()


def test_the_reader_knows_every_option_the_launcher_uses(launched):
    _, view, _, _ = launched
    assert view.unknown == []


def test_only_the_home_the_run_folder_and_capped_memory_are_writable(launched):
    _, view, root, run_dir = launched
    writable = view.writable_mounts()
    assert {m.dest for m in writable} <= WRITABLE, [m.dest for m in writable]
    # a writable bind's source is the user's own folder, never the service's
    sources = {m.source for m in writable if m.kind == "bind"}
    assert sources <= {str(root), str(root / ".hermes"), str(run_dir)}
    for m in writable:
        if m.kind == "tmpfs":
            assert m.size is not None and int(m.size) > 0, f"{m.dest}: memory without a cap"


@pytest.mark.parametrize("path", [
    "/", "/etc/passwd", "/etc/hermes/config.yaml", f"{VENV}/bin/hermes",
    f"{VENV}/lib/python3.11/site-packages/run_agent.py", f"{SITE_DIR}/sitecustomize.py",
    "/usr/lib/python3/dist-packages/x.py", "/dev/null", "/dev/tty", "/proc/sys/kernel/core_pattern",
    "/proc/sysrq-trigger", "/proc/irq/1", "/etc/hosts"])
def test_what_every_user_shares_is_read_only(launched, path):
    _, view, _, _ = launched
    assert not view.writable(path), f"{path} is writable: {view.mount_of(path)}"


@pytest.mark.parametrize("path", [f"{HOME}/notes.md", f"{HOME}/.hermes/state.db",
                                  f"{RUN_DIR}/out", "/tmp/x", "/dev/shm/x"])
def test_the_agents_own_folders_are_writable(launched, path):
    _, view, _, _ = launched
    assert view.writable(path)


def test_every_policy_entry_of_hermes_reads_as_the_service_made_it(launched):
    _, view, _, _ = launched
    for rel, _kind, _how in hermes_policy.BOUND:
        dest = rel if rel.startswith("/") else f"{HOME}/{rel}"
        assert not view.writable(dest), dest
        assert not view.writable(f"{dest}/planted"), dest


def test_the_process_has_namespaces_of_its_own_and_no_privilege(launched):
    _, view, _, _ = launched
    assert {"user", "pid", "ipc", "uts", "cgroup", "net"} <= view.namespaces()
    assert {"--disable-userns", "--die-with-parent", "--new-session"} <= view.flags
    assert view.values["--cap-drop"] == ["ALL"] and "--cap-add" not in view.values
    assert view.values["--uid"] == [str(sandbox_args.SANDBOX_UID)] != ["0"]
    assert view.values["--seccomp"] and int(view.values["--seccomp"][0]) in view_fds(launched)


def view_fds(launched) -> tuple:
    return launched[0].pass_fds


def test_dev_is_a_fresh_read_only_tree_and_proc_a_new_one(launched):
    _, view, _, _ = launched
    assert view.mount_of("/dev/sda").kind == "dev" and not view.writable("/dev/sda")
    assert view.mount_of("/proc/1/mem").kind == "proc"
    assert "--dev-bind" not in view.values and "--dev-bind-try" not in view.values


def _rlimits(argv: list[str]) -> dict[str, str]:
    i = argv.index("/usr/bin/prlimit")
    out = {}
    for a in argv[i + 1:argv.index("--", i)]:
        name, _, value = a.removeprefix("--").partition("=")
        out[name] = value
    return out


def test_without_a_cgroup_processes_and_memory_are_limited_by_rlimits(tmp_path, monkeypatch):
    made, _, _, _ = _launch(tmp_path, monkeypatch, cgroups=None)
    try:
        lim = sandbox.Limits()
        r = _rlimits(made.argv)
        assert int(r["nproc"]) == lim.processes
        assert 0 < int(r["as"]) <= lim.memory_mb * 4 * 1024 * 1024
        assert int(r["nofile"]) == lim.open_files and r["core"] == "0"
        assert int(r["fsize"]) <= lim.file_size_mb * 1024 * 1024
        soft, _, hard = r["cpu"].partition(":")
        assert lim.cpu_seconds < int(soft) <= int(hard)
    finally:
        made.close()


def test_the_hosts_network_is_the_one_namespace_left_out(tmp_path, monkeypatch):
    made, view, _, _ = _launch(tmp_path, monkeypatch, network="host")
    try:
        assert "net" not in view.namespaces()
        assert {"user", "pid", "ipc", "uts"} <= view.namespaces()
    finally:
        made.close()


def test_the_command_runs_from_the_read_only_runtime(launched):
    made, view, _, _ = launched
    command = made.argv[made.argv.index("--", made.argv.index("/usr/bin/prlimit")) + 1]
    assert command.startswith(VENV) and not view.writable(command)

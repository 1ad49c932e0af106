"""``main.py mnote check-kernel`` (docs/mnote-tools.md §Conformance check): it passes on the
reference kernel, over HTTP and as a command, and fails naming the case on kernels each
broken in one way (real loopback servers: tests/support/kernels.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hermes_service.mnote.kernel import check as kernel_check
from hermes_service.mnote.kernel.over_http import HttpKernel
from support.fixtures import ROOT
from support.kernels import KernelServer, seed

CRED_ENV, CRED = "KERNEL_CRED", "kernel-credential-0123456789"
CASES = [name for name, _ in kernel_check.CASES]


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv(CRED_ENV, CRED)
    return seed(tmp_path / "kernel.db")


def check(*args, env_extra=None):
    """``check-kernel`` as a command (a generous bound: against the command kernel each of its
    ~60 calls starts a Python process, seconds each on a loaded machine)."""
    import os
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "mnote", "check-kernel", *args,
                           "--actor", "user_a"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env={**os.environ, **(env_extra or {})})


def test_the_reference_kernel_passes_over_http(db):
    with KernelServer(db, credential=CRED) as kernel:
        res = check("--url", kernel.url, "--credential-env", CRED_ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [["PASS", name] for name in CASES]
    assert lines[-1] == f"check-kernel: {len(CASES)} cases, {len(CASES)} passed or skipped, 0 failed"


def test_the_reference_kernel_command_passes(db):
    res = check("--command", f"{sys.executable} main.py mnote --db {db} kernel-command")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SKIP credential_required" in res.stdout and "FAIL" not in res.stdout


@pytest.mark.parametrize("flaw, failed", [
    ("wrong_call_id", set(CASES) - {"credential_required"}),
    ("no_command_id", {"write", "idempotent_replay", "idempotency_conflict", "block_atomic",
                       "block_expect_hash", "block_revisions", "suggestion_life"}),
    ("dry_run_writes", {"dry_run"}),
    ("no_idempotency", {"idempotent_replay", "idempotency_conflict"}),
    ("conflict_replays", {"idempotency_conflict"}),
    ("leaks_title", {"permission_denied"}),
    ("accepts_unknown_option", {"unknown_option"}),
    ("accepts_malformed", {"malformed_envelope"}),
    ("answers_anyone", {"credential_required"}),
    ("no_block_hash", {"block_atomic", "block_expect_hash", "block_revisions", "suggestion_life"}),
    ("answers_twice", {"suggestion_life"}),
    ("stale_batch_applies", {"block_atomic", "block_expect_hash", "block_revisions"}),
])
def test_a_kernel_breaking_one_rule_fails_that_case(db, monkeypatch, flaw, failed):
    lines = []
    with KernelServer(db, credential=CRED, flaw=flaw) as kernel:
        n = kernel_check.run(HttpKernel(kernel.url, credential_env=CRED_ENV),
                             kernel_check.Target("ws_1", "doc_1", "user_a", "outsider_1"), 5,
                             lines.append)
    assert {line.split()[1] for line in lines if line.startswith("FAIL")} == failed
    assert n == len(failed) and lines[-1].endswith(f"{len(failed)} failed: " + ", ".join(
        name for name in CASES if name in failed))


def test_the_command_line_exits_1_naming_the_failed_case(db):
    with KernelServer(db, credential=CRED, flaw="leaks_title") as kernel:
        res = check("--url", kernel.url, "--credential-env", CRED_ENV)
    assert res.returncode == 1
    assert "FAIL permission_denied" in res.stdout and "the page's title or text" in res.stdout
    assert "1 failed: permission_denied" in res.stdout


def test_an_unreachable_kernel_fails_every_case_and_a_bad_call_is_a_usage_error(db):
    res = check("--url", "http://127.0.0.1:9/", "--timeout", "2")
    assert res.returncode == 1 and res.stdout.count("FAIL ") == len(CASES) - 1
    assert check("--url", "http://x/", "--command", "y").returncode == 2
    res = check("--url", "http://127.0.0.1:9/", "--credential-env", "NO_SUCH_VARIABLE_SET")
    assert res.returncode == 2 and "NO_SUCH_VARIABLE_SET" in res.stderr

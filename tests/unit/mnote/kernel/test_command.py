"""The kernel adapter as a command against real commands (tests/support/kernels.py), no
Hermes: a clean environment, the envelope on stdin, bounded output, the process group killed
at the budget and after the answer (docs/mnote-tools.md §The kernel adapter)."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest

from hermes_service.metrics import REGISTRY
from hermes_service.mnote.kernel.adapter import KernelBackend
from hermes_service.mnote.kernel.command import CommandKernel
from hermes_service.mnote.kernel.wire import KERNEL_UNAVAILABLE
from hermes_service.mnote.page_sqlite import SQLitePageStore
from hermes_service.mnote.tools import ToolExecutor
from support.fixtures import wait_for
from support.kernels import command_argv, seed

CRED_ENV, CRED = "KERNEL_CRED", "kernel-credential-0123456789"


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv(CRED_ENV, CRED)
    monkeypatch.setenv("HERMES_SERVICE_API_KEY", "service-secret-key-0123456789")
    return seed(tmp_path / "kernel.db")


def executor(argv, timeout=10.0):
    return ToolExecutor(backend=KernelBackend(CommandKernel(argv, credential_env=CRED_ENV), timeout))


def envelope(tool="mnote.artifact.create_ai_note", args=None, **over):
    return {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1", "actorId": "user_a",
            "sessionId": "s_1", "runId": "run_1", "toolCallId": f"call_{time.monotonic_ns()}",
            "traceId": "trace_1", "capabilityScope": ["page.read", "page.write", "artifact.write"],
            "args": args if args is not None else
            {} if tool == "mnote.page.get" else {"content": "AI 笔记"},
            **({"idempotencyKey": f"idem_{time.monotonic_ns()}", "dryRun": False}
               if tool != "mnote.page.get" else {}), **over}


def fault(name):
    return envelope(args={"content": f"fault:{name}"})


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_call_runs_the_command_and_the_kernel_writes(db):
    ex = executor(command_argv(db))
    out = ex.invoke(envelope("mnote.page.save", {"content": [{"type": "paragraph", "text": "追加"}]}))
    assert out["ok"] and out["audit"]["effect"] == "write"
    store = SQLitePageStore(db)
    assert [b["text"] for b in store.export_page("doc_1")["blocks"]] == ["第一段", "追加"]
    assert store.audit_rows(out["audit"]["commandId"])
    store.close()
    assert ex.invoke(envelope("mnote.page.get"))["result"]["title"] == "项目计划"


def test_the_command_gets_a_clean_environment_and_the_credential_by_name(db):
    out = executor(command_argv(db)).invoke(fault("env"))
    assert out["error"]["code"] == "mnote_tool_conflict"         # the kernel's answer, as is
    names = set(out["error"]["message"].removeprefix("env: ").split())
    assert names == {"PATH", "HOME", "LANG", "LC_ALL", CRED_ENV}


@pytest.mark.parametrize("name, reason", [
    ("exit_3", "exit_status"), ("huge", "too_large"), ("garbage", "bad_answer"),
    ("wrong_call", "wrong_call"),
])
def test_a_command_that_fails_is_one_code_and_not_retried(db, caplog, name, reason):
    before = REGISTRY.get_sample_value("hermes_service_kernel_retries_total",
                                       {"transport": "command"}) or 0
    caplog.set_level(logging.WARNING, "hermes_service.mnote.kernel")
    out = executor(command_argv(db)).invoke(fault(name))
    assert out["error"]["code"] == KERNEL_UNAVAILABLE and "SECRET" not in json.dumps(out)
    assert (REGISTRY.get_sample_value("hermes_service_kernel_retries_total",
                                      {"transport": "command"}) or 0) == before
    [line] = [r for r in caplog.records if r.name.startswith("hermes_service.mnote.kernel")]
    assert f": {reason}: " in line.getMessage() and line.trace_id == "trace_1"
    assert CRED not in caplog.text                       # exit_3 prints it to stderr
    if name == "exit_3":
        assert "SECRET-STDERR ***" in caplog.text        # the stderr tail, redacted


def test_a_command_that_never_exits_is_killed_with_its_group_at_the_budget(db):
    started = time.monotonic()
    out = executor(command_argv(db), timeout=1.5).invoke(fault("hang"))
    assert out["error"]["code"] == KERNEL_UNAVAILABLE and "时限" in out["error"]["message"]
    assert time.monotonic() - started < 6
    [pid] = map(int, db.with_suffix(".pids").read_text().split())
    wait_for(lambda: not alive(pid), "the hung command to be gone", timeout=5)


def test_what_an_answered_command_left_running_is_killed(db):
    started = time.monotonic()
    out = executor(command_argv(db)).invoke(fault("hang_child"))
    assert out["ok"] and time.monotonic() - started < 5     # not held by the child's pipes
    [pid] = map(int, db.with_suffix(".pids").read_text().split())
    wait_for(lambda: not alive(pid), "the left child to be gone", timeout=5)


def test_a_command_killed_by_a_signal_is_retried_once_and_writes_once(db):
    out = executor(command_argv(db)).invoke(fault("signal_once"))
    assert out["ok"], out
    store = SQLitePageStore(db)
    notes = [a for a in store.export_page("doc_1")["artifacts"] if a["content"] == "fault:signal_once"]
    store.close()
    assert len(notes) == 1


def test_a_missing_program_is_unreachable_without_retries(db, tmp_path):
    out = executor([str(tmp_path / "no-such-kernel")]).invoke(fault("none"))
    assert out["error"]["code"] == KERNEL_UNAVAILABLE and "无法连接" in out["error"]["message"]


def test_a_command_that_does_not_read_its_input_does_not_block_the_call(db):
    script = "import sys; sys.stdout.write('{}'); sys.stdout.flush()"
    kernel = CommandKernel([sys.executable, "-c", script])
    status, out = kernel.exchange(b"x" * (4 * 1024 * 1024), time.monotonic() + 10)
    assert (status, out) == (0, b"{}")


def test_the_service_secrets_stay_out_of_the_commands_environment(db, monkeypatch):
    monkeypatch.setenv("SCRIPTED_PROVIDER_KEY", "sk-provider-secret")
    script = "import os, sys; sys.stdout.write(' '.join(f'{k}={v}' for k, v in os.environ.items()))"
    status, out = CommandKernel([sys.executable, "-c", script], credential_env=CRED_ENV).exchange(
        b"{}", time.monotonic() + 10)
    env = dict(item.split("=", 1) for item in out.decode().split())
    assert env[CRED_ENV] == CRED and env["PATH"] == os.environ["PATH"]
    assert "service-secret" not in out.decode() and "sk-provider" not in out.decode()

"""The rule of the tests' ``sandbox`` mark (tests/support/sandbox_needed.py): a failed
start-up check of an installed bubblewrap fails the sandbox tests where they run as root
(CI) or are asked to, and skips them only where no sandbox can be."""
from __future__ import annotations

import pytest

from hermes_service import sandbox
from support import sandbox_needed


@pytest.mark.parametrize(("bwrap", "reason", "root", "env", "expected"), [
    ("/usr/bin/bwrap", None, True, None, None),
    (None, "not installed", True, None, "skip"),
    ("/usr/bin/bwrap", "user namespaces are off", True, None, "fail"),
    ("/usr/bin/bwrap", "user namespaces are off", False, None, "skip"),
    ("/usr/bin/bwrap", "user namespaces are off", False, "1", "fail"),
])
def test_a_broken_sandbox_fails_where_one_should_work(monkeypatch, bwrap, reason, root, env,
                                                       expected):
    monkeypatch.setattr(sandbox, "probe", lambda: sandbox.Probe(bwrap, reason, None, ""))
    monkeypatch.setattr(sandbox_needed.os, "geteuid", lambda: 0 if root else 1000)
    if env:
        monkeypatch.setenv(sandbox_needed.REQUIRE_ENV, env)
    else:
        monkeypatch.delenv(sandbox_needed.REQUIRE_ENV, raising=False)
    got = sandbox_needed.verdict()
    assert (got and got[0]) == expected
    if got:
        assert (reason or "installed") in got[1]

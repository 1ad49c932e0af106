"""Tests that need a working bubblewrap sandbox (``@pytest.mark.sandbox``, applied by
tests/conftest.py). Where bubblewrap cannot be there — not installed and no root to install
it — such a test skips and says why; where it should work (installed, and the tests run as
root as CI does, or ``HERMES_TESTS_REQUIRE_SANDBOX=1``), a failed start-up check FAILS the
test with the probe's reason instead of hiding every sandbox test behind a skip."""
from __future__ import annotations

import os

from hermes_service import sandbox

REQUIRE_ENV = "HERMES_TESTS_REQUIRE_SANDBOX"


def verdict() -> tuple[str, str] | None:
    """None when a sandbox starts here; else ``("skip" | "fail", why)``."""
    probe = sandbox.probe()
    if probe.usable:
        return None
    if probe.bwrap is None:
        return "skip", "bubblewrap is not installed (make setup installs it as root)"
    why = f"bubblewrap is installed but cannot start a sandbox here: {probe.reason}"
    if os.geteuid() == 0 or os.environ.get(REQUIRE_ENV) == "1":
        return "fail", why
    return "skip", why

"""The body worker (hermes_service/model_proxy/body_worker.py) loads only what it needs: its
address space is capped (``RLIMIT_AS``), so what it imports is memory a costly body cannot
use. Its package's ``__init__`` imports nothing, so ``python -m`` of it pulls in no server."""
from __future__ import annotations

import subprocess
import sys


def test_the_worker_imports_only_the_policy_and_the_request_shape():
    code = ("import sys, hermes_service.model_proxy.body_worker; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('hermes_service'))))")
    out = subprocess.run([sys.executable, "-E", "-s", "-c", code], capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    assert out == ["hermes_service", "hermes_service.model_proxy",
                   "hermes_service.model_proxy.body_worker", "hermes_service.model_proxy.policy",
                   "hermes_service.model_proxy.request"]

"""Registers the shared fixtures (tests/support/fixtures.py) for tests/unit and tests/e2e.

unit: everything runs in the test process — the Flask app, the scripted model, stubs at the
runner's seam; the only other processes are ones a test scripts itself (python workers,
``sleep``, the fake ACP agent) and the operator commands that exit without serving.
e2e: a real part — the service under waitress, the hermes CLI or ACP agent, nginx,
bubblewrap, promtool, systemd, make, generated clients, the fuzzer.
"""
from support.fixtures import (  # noqa: F401  (fixtures: pytest finds them by name here)
    app_factory, make_config, model, other, service, start_service, stub, stubbed_app)

"""Registers the shared fixtures (tests/support/fixtures.py) for tests/unit and tests/e2e.

unit: everything runs in the test process — the Flask app, the scripted model, stubs at the
runner's seam; the only other processes are ones a test scripts itself (python workers,
``sleep``, the fake ACP agent, ``openssl``) and ``main.py`` runs that end before serving
(the operator commands, a start the config check refuses).
e2e: a real part — the service under waitress, the hermes CLI or ACP agent, nginx,
bubblewrap, promtool, systemd, a real `make` run, generated clients, the fuzzer.
"""
from support.fixtures import (  # noqa: F401  (fixtures: pytest finds them by name here)
    app_factory, make_config, model, other, service, start_service, stub, stubbed_app)

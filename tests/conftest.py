"""Registers the shared fixtures (tests/support/fixtures.py) for tests/unit and tests/e2e, and
orders the tests for xdist (tests/support/ordering.py).

unit: everything runs in the test process — the Flask app, the scripted model, stubs at the
runner's seam; the only other processes are ones a test scripts itself (python workers,
``sleep``, the fake ACP agent, ``openssl``) and ``main.py`` runs that end before serving
(the operator commands, a start the config check refuses).
e2e: a real part — the service under waitress, the hermes CLI or ACP agent, nginx,
bubblewrap, promtool, systemd, a real `make` run, generated clients, the fuzzer.
"""
import pytest

from support import sandbox_needed
from support.fixtures import (  # noqa: F401  (fixtures: pytest finds them by name here)
    app_factory,
    make_config,
    model,
    other,
    service,
    start_service,
    stub,
    stubbed_app,
)
from support.ordering import order
from support.postgres import pg_url, postgres  # noqa: F401  (fixtures, as above)


def pytest_runtest_setup(item):
    """``@pytest.mark.sandbox``: skip where no sandbox can be, fail where one should work
    (tests/support/sandbox_needed.py)."""
    if item.get_closest_marker("sandbox") is not None:
        found = sandbox_needed.verdict()
        if found is not None:
            how, why = found
            (pytest.skip if how == "skip" else pytest.fail)(why)


@pytest.hookimpl(tryfirst=True)   # before xdist's own, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config, items):
    """In an xdist worker (each collects the same items): longest work first, a module sharing
    a fixture in one work unit (tests/support/ordering.py). A run without ``-n`` keeps the
    collection order."""
    if hasattr(config, "workerinput"):
        order(items)

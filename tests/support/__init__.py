"""What the unit and end-to-end tests share (docs: docs/testing.md).

* :mod:`support.fixtures` — the fixtures (``model``, ``service`` / ``start_service``,
  ``make_config`` / ``app_factory``, ``stub`` / ``stubbed_app``, ``other``) and the helpers they
  are built from (``ServiceProcess``, ``base_config``, ``StubTurns``, ``wait_for`` …);
  ``tests/support/fixtures.py`` registers the fixtures for both suites.
* :mod:`support.sse_client` — a Server-Sent Events reader for the client routes.
* :mod:`support.hermes_record` — writes turns into a home's ``state.db`` the way Hermes does.
* :mod:`support.nginx_harness` — the shipped nginx configuration on free ports.
* :mod:`support.recording_proxy` — an HTTP(S) forward proxy that records what passes.
* :mod:`support.shipped` — the files as committed (what a clean clone gets).
* ``fake_acp_agent.py`` and ``generated_client_flows.py`` — scripts the tests run in their own
  processes (a scripted ACP agent; the flows of a generated Python client).
"""

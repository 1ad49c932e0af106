"""The model pass-through: Hermes processes reach the provider through the service, which
adds the real key on the way out (docs/sandbox.md §Model pass-through). Standard library
only: :class:`http.server.ThreadingHTTPServer` in front, :mod:`http.client` and :mod:`ssl`
behind.

* :mod:`.proxy` — :class:`ModelProxy`: lifetime, reload, credentials, shares and budget;
* :mod:`.handler` — the HTTP server and the intake of a request (every refusal);
* :mod:`.relay` — forwarding a checked request and relaying the answer;
* :mod:`.body_check` — checking a body inline or in a worker process, at a bounded cost;
* :mod:`.upstream` — the provider's settings, its HTTP proxy, the kept connections;
* :mod:`.limits` — the bounds.

What it forwards is :mod:`hermes_service.model_policy`; the tokens it counts,
:mod:`hermes_service.model_usage`.
"""
from .proxy import ModelProxy
from .relay import openai_error
from .upstream import upstream_proxy_for

__all__ = ["ModelProxy", "openai_error", "upstream_proxy_for"]

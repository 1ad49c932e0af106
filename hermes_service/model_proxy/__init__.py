"""The model pass-through: Hermes processes reach the provider through the service, which
adds the real key on the way out (docs/sandbox.md §Model pass-through). Standard library
only: :class:`http.server.ThreadingHTTPServer` in front, :mod:`http.client` and :mod:`ssl`
behind.

* :mod:`.proxy` — :class:`ModelProxy`: lifetime, reload, credentials, shares and budget;
* :mod:`.handler` — the HTTP server and the intake of a request (every refusal);
* :mod:`.relay` — forwarding a checked request and relaying the answer;
* :mod:`.body_check` — checking a body inline or in a worker process, at a bounded cost;
* :mod:`.upstream` — the provider's settings, its HTTP proxy, the kept connections;
* :mod:`.limits` — the bounds;
* :mod:`.policy` + :mod:`.request` — what it forwards: methods, paths, models, headers, the
  body's shape object by object;
* :mod:`.usage` — the tokens it counts, per user and day (``data/model_usage.db``);
* :mod:`.body_worker` — the memory-capped worker process that checks a costly body.

It may import the core's leaves (:mod:`hermes_service.errors`, :mod:`hermes_service.metrics`,
:mod:`hermes_service.json_cost`, :mod:`hermes_service.embedded_http`) and the shared
storage's usage store type (``storage``, for type checks only); never the sandbox, the
homes, the runners or the web. This ``__init__`` imports nothing: the body worker runs as
``python -m hermes_service.model_proxy.body_worker`` and loads only :mod:`.policy` and
:mod:`.request`.
"""

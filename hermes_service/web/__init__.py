"""The web: the request plumbing, the route families and the core's routes (docs/v1-api.md,
docs/api-description.md).

* :mod:`.helpers` — request helpers every blueprint uses: strict JSON, the error response in
  the route family's shape, a route's contract (``@documented``), ``Idempotency-Key``;
* :mod:`.routing` — the route families (paths, auth, key scope, error shape);
* :mod:`.hooks` — request hooks: request id, client address, authentication, access log;
* :mod:`.tokens` — the random hex of request and trace ids;
* :mod:`.framing` — waitress's request parser, refusing ambiguous body framing;
* :mod:`.api_v1` — ``/health``, ``/api/v1/*``; :mod:`.openapi` — ``/openapi.json``, ``/docs``;
  :mod:`.ops` — ``/metrics``.

It may import the core below it (config, errors, idempotency, security, preflight, logs,
metrics, :mod:`hermes_service.service_objects`, :mod:`hermes_service.conversations`' request,
the runners' public surface, the shared storage's store types); nothing below it
imports the web, except the extensions (``mnote/``), which add their routes through it.
"""

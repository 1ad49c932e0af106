"""A sandbox's network (``hermes.sandbox.network: isolated``; docs/sandbox.md §Network).

* :mod:`.sockets` — the Unix sockets of each sandbox (to the model pass-through, this service,
  the egress proxy) with per-sandbox connection caps, on one asyncio loop;
* :mod:`.egress_policy` — the egress allow/deny rules and the address deny set;
* :mod:`.egress_proxy` — the egress proxy's HTTP CONNECT / plain-HTTP protocol;
* :mod:`.service_gate` — what a sandbox may ask of this service through its socket;
* :mod:`.relay` — the one byte pipe of every relay (splice or a reused buffer, byte counts,
  half-close);
* :mod:`.http_head` — a sandbox's request heads read strictly (ASCII numbers, no control
  characters);
* :mod:`.lookups` — each sandbox's own name lookups (a cap in flight, a deadline);
* :mod:`.own_addresses` — the host's own addresses, read again when they change;
* :mod:`.refusals` — refusals logged once per sandbox and reason per interval, with a count.

It may import the core's leaves (:mod:`hermes_service.instance`, :mod:`hermes_service.metrics`)
and :mod:`hermes_service.hermes_site.netforward` (the forwarder inside Hermes it serves); never
the rest of ``sandbox/`` (the launcher imports it, not the other way).
"""

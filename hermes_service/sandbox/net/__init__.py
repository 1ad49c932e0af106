"""A sandbox's network (``hermes.sandbox.network: isolated``; docs/sandbox.md §Network).

* :mod:`.relay` — the one byte pipe of every relay (splice or a reused buffer, byte counts,
  half-close);
* :mod:`.lookups` — each sandbox's own name lookups (a cap in flight, a deadline);
* :mod:`.own_addresses` — the host's own addresses, read again when they change;
* :mod:`.refusals` — refusals logged once per sandbox and reason per interval, with a count.

It imports nothing of the rest of ``sandbox/`` (the launcher imports it, not the other way).
"""

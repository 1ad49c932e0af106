"""The shared storage of several service nodes: PostgreSQL (``storage.url``; docs/scaling.md).

* :mod:`.engine` — the connection pool, transactions, and the one error a node answers when the
  database cannot be reached (503 ``storage_unavailable``);
* :mod:`.schema` — the migrations (SQL files in ``schema/``), applied once at start;
* :mod:`.leases` — one owner per user: a lease with an epoch on the database's clock, and the
  fence every write transaction of a user checks;
* :mod:`.snapshots` — the users' homes as content-addressed chunks and a manifest per turn.

Without a ``storage`` section none of this is used: the node keeps everything on its own disk
(the single-node default).

It may import the core's leaves (config, errors, homefs, instance, the session registry's and
idempotency's record types) and what it snapshots or counts (``homes.state_db``,
``disk.use``, ``model_proxy.usage``); never the runners, the web or the extensions, which
use it through :class:`.node.SharedNode` built in ``services.py``.
"""

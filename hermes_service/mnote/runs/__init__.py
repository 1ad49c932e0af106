"""The page AI panel's background runs (docs/mnote-client.md, docs/data-and-durability.md §Runs
and their events).

* :mod:`.manager` — :class:`RunManager`: runs started, kept for replay, found across
  processes, aborted; each actor's share;
* :mod:`.run` + :mod:`.questions` — one run: its replayable event log, its questions to the
  user;
* :mod:`.foreign` — a run of another process, read from its log, and its poller;
* :mod:`.log` — the durable run event logs in ``data/run-events/``;
* :mod:`.streams` — open event streams and the watch that frees a vanished client's.

It may import the core's leaves (errors, instance, limits, logs) and the extension's metrics
and event bounds (``mnote/``), and the shared storage's run archive type (``storage``);
never the runners or the web.
"""

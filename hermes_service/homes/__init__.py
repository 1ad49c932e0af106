"""Users' Hermes homes and what the service reads of them (docs/sandbox.md, docs/runners.md
§Answers, docs/data-and-durability.md).

* :mod:`.users` — one home per user from ``users_template/``; the environment of its Hermes
  processes;
* :mod:`.state_db` — opening a home's ``state.db`` without trusting it: bounded in values,
  rows, bytes, time and readers;
* :mod:`.hermes_state` — that ``state.db`` read as Hermes's record: answers, transcripts,
  counts, usage;
* :mod:`.transcript` — what its rows show: Hermes's scaffolding left out, merged summaries
  unwrapped, a turn's text;
* :mod:`.trim` — the operator's way out of a home at its quota (``home-trim``).

It may import the core's leaves (config, errors, :mod:`hermes_service.homefs`,
:mod:`hermes_service.json_cost`) and the sandbox's settings (the environment names a process
gets), and :mod:`hermes_service.disk.use` (what a home takes: ``home-trim``'s listing);
never the runners, the web or the disk watch. :mod:`hermes_service.homefs` (no-follow
access to a folder the agent can write) stays beside the package: the sandbox uses it too, and
the homes import the sandbox.
"""

"""The mnote extension (contracts: hermes-client-proxy-contract-v1,
mnote-hermes-plugin-tool-contract-v1), the outer layer: the core never imports it, it wires
itself in through the extension seam (:mod:`hermes_service.extensions`; :mod:`.extension`).

* :mod:`.extension` — what it builds and registers (objects, routes, retention, CLI, metrics);
* :mod:`.client` — ``/api/hermes/client/*``, the page AI panel's routes (runs, events, abort);
* :mod:`.runs` + :mod:`.run_log` — background runs, their events and durable event logs;
* :mod:`.endpoint` + :mod:`.gateway` — ``POST /api/hermes/tools/invoke`` and run tokens;
* :mod:`.tools` + :mod:`.schemas` — the ``mnote.*`` tools: registry, schemas, executor;
  :mod:`.blocks` + :mod:`.block_store` — the block tools and suggestions;
  :mod:`.client_suggestions` — the panel's review of suggestions;
* :mod:`.page_store` — the page store interface and its SQLite adapter;
* :mod:`.kernel_adapter` (+ :mod:`.kernel_wire`, :mod:`.kernel_http`, :mod:`.kernel_command`) —
  the tools against mnote's kernel; :mod:`.kernel_reference` — the reference kernel;
  :mod:`.kernel_check` — the conformance check;
* :mod:`.events` — the run events as JSON schemas (the OpenAPI document);
* :mod:`.metrics` — its Prometheus instruments; :mod:`.cli` — the ``mnote`` commands;
* :mod:`.demo` — ``make demo``: the panel against a scripted stand-in model.
"""
from __future__ import annotations

from .extension import MnoteExtension

#: the extension object :func:`hermes_service.installed.extensions` lists
extension = MnoteExtension()

"""The page tools against mnote's kernel (``mnote.page_store.kind: http | command``;
docs/mnote-tools.md §The kernel adapter).

* :mod:`.adapter` — the tool executor's backend for a kernel;
* :mod:`.wire` — the contract's §2 envelope sent and the §3 answers accepted;
* :mod:`.over_http` + :mod:`.command` — the two transports;
* :mod:`.reference` — the reference kernel (``serve-kernel``, ``kernel-command``);
* :mod:`.check` — ``check-kernel``, the conformance check.

It may import the extension's page store, tools and metrics (``mnote/``); nothing of the core.
"""

"""The warm runner: ``hermes acp`` processes spoken to over the Agent Client Protocol
(``hermes.runner: acp``; docs/runners.md §The ACP runner; measured facts:
docs/hermes-cli-notes.md). The service is the client, through the protocol's own Python
package (``agent-client-protocol``, pinned to the version Hermes pins).

* :mod:`.sink` — where one prompt's updates go: deltas, held error text, tool calls;
* :mod:`.client` — the client side of the protocol, and Hermes's questions to the user;
* :mod:`.process` — one ``hermes acp`` process and the sessions it opens;
* :mod:`.pool` — the warm processes: start, reuse, retire and replace, close;
* :mod:`.turn` — one turn on a process: its session, the prompt, an early end;
* :mod:`.runner` — :class:`AcpRunner`: its loop, its settings, ``run_turn``.
"""
from .client import tool_identity
from .process import ACP_MESSAGE_BYTES
from .runner import AcpRunner
from .sink import could_be_error_text

__all__ = ["ACP_MESSAGE_BYTES", "AcpRunner", "could_be_error_text", "tool_identity"]

"""Attacks on the OpenAI-compatible routes that both runners' e2e modules make
(tests/e2e/test_e2e_openai.py, test_e2e_openai_cli.py)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from support.fixtures import wait_for


def inflated_turn(client, model, home: Path, gate: str):
    """A turn during which the agent's ``state.db`` (the test writes it for the agent, while
    the turn waits on the model's gate ``gate``) claims 10^15 prompt tokens for the session.
    Returns the stream's ``usage``."""
    first = client.chat.completions.with_raw_response.create(
        model="hermes", messages=[{"role": "user", "content": f"count me {gate}"}])
    sid = first.headers["X-Hermes-Session-Id"]
    text = f"[[gate:{gate}]] again"
    raw = client.chat.completions.with_raw_response.create(
        model="hermes", messages=[{"role": "user", "content": text}], stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Hermes-Session-Id": sid})
    wait_for(lambda: model.requests_with(text), "the gated model request")
    with sqlite3.connect(home / ".hermes" / "state.db") as db:
        db.execute("UPDATE sessions SET input_tokens = 1000000000000000")
    model.release(gate)
    chunks = list(raw.parse())
    assert chunks[-1].choices == []
    return chunks[-1].usage

"""The tables of the home snapshots (:mod:`.snapshots`; docs/data-and-durability.md §Home
snapshots), as SQL statements the storage migration applies in order (each idempotent).

* ``home_chunks`` — content-addressed chunks: ``hash`` is the SHA-256 (32 bytes) of
  ``data`` (at most :data:`~.snapshot_manifest.CHUNK_BYTES`, 64 KiB), shared by every user
  and every manifest that holds the same bytes; stored once.
* ``home_manifests`` — one per saved turn: the user, a sequence number per user (1, 2, …),
  when it was made, the totals, ``entries`` (JSON: every folder and file with its relative
  path, mode and size, and how many chunks each file has) and ``chunks`` (the files' chunk
  hashes in order, file after file). The chunks a manifest names are what keeps them alive:
  the garbage collection deletes a chunk no manifest names.
"""
from __future__ import annotations

SCHEMA: list[str] = [
    """CREATE TABLE IF NOT EXISTS home_chunks (
        hash bytea PRIMARY KEY CHECK (octet_length(hash) = 32),
        data bytea NOT NULL,
        created timestamptz NOT NULL DEFAULT now()
    )""",
    # lz4 where the server has it (PostgreSQL 14+ built with lz4, as Debian's is): a 64 KiB
    # chunk is compressed ~10x faster than with the default pglz (bench/snapshot.py)
    """DO $$ BEGIN
        EXECUTE 'ALTER TABLE home_chunks ALTER COLUMN data SET COMPRESSION lz4';
    EXCEPTION WHEN others THEN NULL;
    END $$""",
    """CREATE TABLE IF NOT EXISTS home_manifests (
        id bigserial PRIMARY KEY,
        user_id text NOT NULL,
        seq bigint NOT NULL,
        created timestamptz NOT NULL DEFAULT now(),
        files integer NOT NULL,
        bytes bigint NOT NULL,
        entries jsonb NOT NULL,
        chunks bytea[] NOT NULL,
        UNIQUE (user_id, seq)
    )""",
]

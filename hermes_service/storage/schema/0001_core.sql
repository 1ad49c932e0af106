-- The core's tables of the shared storage (docs/scaling.md §Shared storage).

-- One owner per user: the node holding the lease (holder), until expires_at (the database's
-- clock), under an epoch raised at every take; every write of a user checks it (the fence).
CREATE TABLE leases (
    user_id     text PRIMARY KEY,
    holder      text NOT NULL,
    epoch       bigint NOT NULL,
    expires_at  timestamptz NOT NULL
);

-- The session registry (SessionStore's records), one row per session.
CREATE TABLE sessions (
    session_id  text PRIMARY KEY,
    user_id     text NOT NULL,
    created_at  text NOT NULL,
    record      jsonb NOT NULL
);
CREATE INDEX sessions_by_user ON sessions (user_id, created_at);

-- The core's tables of the shared storage (docs/scaling.md §Shared storage).

-- One owner per user: the node holding the lease (holder), until expires_at (the database's
-- clock), under an epoch raised at every take; every write of a user checks it (the fence).
-- wanted_at: another node asked for the user (the holder hands it over when idle).
CREATE TABLE leases (
    user_id     text PRIMARY KEY,
    holder      text NOT NULL,
    epoch       bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    wanted_at   timestamptz
);

-- The session registry (SessionStore's records), one row per session.
CREATE TABLE sessions (
    session_id  text PRIMARY KEY,
    user_id     text NOT NULL,
    created_at  text NOT NULL,
    record      jsonb NOT NULL
);
CREATE INDEX sessions_by_user ON sessions (user_id, created_at);

-- Finished runs of the panel (their meta record and every event, the terminal one last), so
-- GET /api/hermes/client/events/{runId} replays on any node.
CREATE TABLE runs (
    run_id      text PRIMARY KEY,
    user_id     text NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    meta        jsonb NOT NULL,
    events      jsonb NOT NULL
);
CREATE INDEX runs_finished ON runs (finished_at);

-- Idempotency-Key records (hermes_service/idempotency.py's table, shared by every node).
CREATE TABLE idempotency (
    scope       text NOT NULL,
    idem_key    text NOT NULL,
    fingerprint text NOT NULL,
    state       text NOT NULL,
    owner       text,
    status      integer,
    content_type text,
    body        bytea,
    api_key     text NOT NULL DEFAULT '-',
    created_at  double precision NOT NULL,
    expires_at  double precision NOT NULL,
    PRIMARY KEY (scope, idem_key)
);
CREATE INDEX idempotency_expires ON idempotency (expires_at);
CREATE INDEX idempotency_api_key ON idempotency (api_key, created_at);

-- The nodes alive: each writes seen_at every third of a lease TTL (an Idempotency-Key record
-- in progress on a node not seen for two TTLs is taken over).
CREATE TABLE nodes (
    name        text PRIMARY KEY,
    seen_at     timestamptz NOT NULL
);

-- Model usage per user and UTC day (hermes_service/model_usage.py's table): the daily token
-- budget (hermes.limits.daily_tokens) counts every node's requests.
CREATE TABLE model_usage (
    user_id            text NOT NULL,
    day                text NOT NULL,
    requests           bigint NOT NULL DEFAULT 0,
    prompt_tokens      bigint NOT NULL DEFAULT 0,
    completion_tokens  bigint NOT NULL DEFAULT 0,
    estimated_requests bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (user_id, day)
);

-- Bulletin schema, version 1. PostgreSQL is the single source of truth: a gateway keeps
-- nothing that a restart would lose.

CREATE TABLE users (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    is_admin    boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE nodes (
    id                bigserial PRIMARY KEY,
    name              text NOT NULL UNIQUE,
    gpus              jsonb NOT NULL DEFAULT '[]',
    cpu_slots         integer NOT NULL DEFAULT 0,
    protocol_version  integer NOT NULL DEFAULT 1,
    registered_at     timestamptz,
    last_heartbeat    timestamptz
);

-- Only hashes of tokens are stored. A user token names a user, a node token a node.
CREATE TABLE tokens (
    token_hash  bytea PRIMARY KEY,
    kind        text NOT NULL CHECK (kind IN ('user', 'node')),
    user_id     bigint REFERENCES users (id) ON DELETE CASCADE,
    node_id     bigint REFERENCES nodes (id) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'user') = (user_id IS NOT NULL)),
    CHECK ((kind = 'node') = (node_id IS NOT NULL))
);

-- Big payloads and results, stored as ordered chunks so they stream in and out.
CREATE TABLE blobs (
    id          uuid PRIMARY KEY,
    owner_id    bigint NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    size        bigint NOT NULL DEFAULT 0,
    complete    boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE blob_chunks (
    blob_id  uuid NOT NULL REFERENCES blobs (id) ON DELETE CASCADE,
    seq      integer NOT NULL,
    data     bytea NOT NULL,
    PRIMARY KEY (blob_id, seq)
);

CREATE TABLE invocations (
    id               uuid PRIMARY KEY,
    owner_id         bigint NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    idempotency_key  text NOT NULL,
    function_name    text NOT NULL DEFAULT '',
    state            text NOT NULL DEFAULT 'queued' CHECK (state IN
                       ('queued', 'assigned', 'running', 'succeeded', 'failed', 'timed_out', 'cancelled')),
    gpus             integer NOT NULL CHECK (gpus >= 0),
    max_retries      integer NOT NULL CHECK (max_retries >= 0),
    timeout_s        double precision,
    -- attempts counts assignments; epoch fences every write of the attempt that holds it.
    attempts         integer NOT NULL DEFAULT 0,
    epoch            integer NOT NULL DEFAULT 0,
    node_id          bigint REFERENCES nodes (id),
    gpu_indices      integer[] NOT NULL DEFAULT '{}',
    lease_expires_at timestamptz,
    payload          bytea,
    payload_blob     uuid REFERENCES blobs (id),
    payload_size     bigint NOT NULL DEFAULT 0,
    result           bytea,
    result_blob      uuid REFERENCES blobs (id),
    error_kind       text,
    error_type       text,
    error_message    text,
    traceback        text,
    log_count        integer NOT NULL DEFAULT 0,
    -- Highest nodelet log batch sequence applied for the current epoch (retried posts skip it).
    log_ack          integer NOT NULL DEFAULT -1,
    submitted_at     timestamptz NOT NULL DEFAULT now(),
    scheduled_at     timestamptz,
    delivered_at     timestamptz,
    started_at       timestamptz,
    finished_at      timestamptz,
    UNIQUE (owner_id, idempotency_key),
    CHECK (payload IS NOT NULL OR payload_blob IS NOT NULL)
);

CREATE INDEX invocations_queued ON invocations (submitted_at, id) WHERE state = 'queued';
CREATE INDEX invocations_leased ON invocations (node_id) WHERE state IN ('assigned', 'running');
CREATE INDEX invocations_owner ON invocations (owner_id, submitted_at DESC);

CREATE TABLE invocation_logs (
    invocation_id  uuid NOT NULL REFERENCES invocations (id) ON DELETE CASCADE,
    n              integer NOT NULL,
    stream         smallint NOT NULL,
    data           bytea NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (invocation_id, n)
);

-- Registered functions: a function stored by value under a name, one row per version. The
-- version is a content hash of the pickled function and its resources, so registering
-- unchanged code again finds the row it made before. `payload` (inline) or `payload_blob`
-- holds the pickled function; invocations copy the inline bytes or share the blob.
-- visibility: 'private' (the owner only), 'group' (users of the owner's group), 'cluster'.
CREATE TABLE functions (
    id              bigserial PRIMARY KEY,
    owner_id        bigint NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    name            text NOT NULL,
    version         text NOT NULL,
    visibility      text NOT NULL DEFAULT 'private'
                      CHECK (visibility IN ('private', 'group', 'cluster')),
    description     text NOT NULL DEFAULT '',
    gpus            integer NOT NULL DEFAULT 0 CHECK (gpus >= 0),
    gpu_model       text,
    gpu_memory_mb   integer,
    timeout_s       double precision,
    max_retries     integer NOT NULL DEFAULT 2,
    expected_s      double precision,
    payload         bytea,
    payload_blob    uuid REFERENCES blobs (id),
    payload_size    bigint NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- The last time it was registered (again): the latest version is the one named last.
    registered_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (owner_id, name, version),
    CHECK ((payload IS NULL) <> (payload_blob IS NULL))
);
CREATE INDEX functions_latest ON functions (owner_id, name, registered_at DESC);

-- Invocations of registered functions: which version, and the JSON arguments they were
-- invoked with over HTTP (`{"args": [...], "kwargs": {...}}`; NULL for pickled sdk calls).
-- A JSON invocation's result also comes back as JSON (`result_json`), or why it could not
-- (`result_json_error`: the pickled result is then still there).
ALTER TABLE invocations
    ADD COLUMN function_id bigint REFERENCES functions (id) ON DELETE SET NULL,
    ADD COLUMN function_version text,
    ADD COLUMN arguments bytea,
    ADD COLUMN result_json bytea,
    ADD COLUMN result_json_error text;

-- Idempotency-Key headers of submissions: the request they came with (a hash of its route,
-- parameters and body) and the invocations it made, written in the transaction that made
-- them, so one key makes them once. `answered_at` NULL: the request is still answering (an
-- invoke waiting for its result); a retry meanwhile is told to come back.
CREATE TABLE idempotency_keys (
    owner_id        bigint NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    key             text NOT NULL,
    request_hash    bytea NOT NULL,
    invocation_ids  uuid[] NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now(),
    answered_at     timestamptz,
    PRIMARY KEY (owner_id, key)
);
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);


-- Retention purges blobs that nothing refers to any more.
CREATE INDEX invocations_payload_blob ON invocations (payload_blob) WHERE payload_blob IS NOT NULL;
CREATE INDEX invocations_result_blob ON invocations (result_blob) WHERE result_blob IS NOT NULL;
CREATE INDEX functions_payload_blob ON functions (payload_blob) WHERE payload_blob IS NOT NULL;
CREATE INDEX blobs_created ON blobs (created_at);

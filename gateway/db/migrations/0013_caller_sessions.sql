-- Caller liveness: an sdk waiting for its calls (a blocking call, a map) names its session
-- in each call and keeps the session alive. A call whose session has not been heard from for
-- caller_timeout_s is cancelled, freeing its GPU; one whose session is merely late is not
-- started meanwhile (gateway/db.py: queued, abandon_callers). Detached calls have no session.
CREATE TABLE caller_sessions (
    owner_id  bigint NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    id        uuid NOT NULL,
    seen_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (owner_id, id)
);
CREATE INDEX caller_sessions_seen ON caller_sessions (seen_at);
ALTER TABLE invocations ADD COLUMN caller_session uuid;
CREATE INDEX invocations_waited_for ON invocations (owner_id, caller_session)
    WHERE caller_session IS NOT NULL AND state IN ('queued', 'assigned', 'running');

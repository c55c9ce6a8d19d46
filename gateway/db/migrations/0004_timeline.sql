-- The time-to-first-loss timeline: when the node had a worker for the call (and whether it
-- was already running), when the user's code ran (node clock), and when the caller first
-- fetched the result.
ALTER TABLE invocations
    ADD COLUMN worker_acquired_at timestamptz,
    ADD COLUMN code_started_at timestamptz,
    ADD COLUMN code_finished_at timestamptz,
    ADD COLUMN warm boolean,
    ADD COLUMN fetched_at timestamptz;

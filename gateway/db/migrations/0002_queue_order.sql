-- Queue order is submission order, call by call: a batch of calls shares one submitted_at
-- (the transaction's time), so ordering by it left the calls of one map in random order.
ALTER TABLE invocations ADD COLUMN seq bigserial;
DROP INDEX invocations_queued;
CREATE INDEX invocations_queued ON invocations (seq) WHERE state = 'queued';
DROP INDEX invocations_owner;
CREATE INDEX invocations_owner ON invocations (owner_id, seq DESC);

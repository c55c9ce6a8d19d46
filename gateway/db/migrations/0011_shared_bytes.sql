-- The bytes of an invocation's result file in the shared directory, as its node reported
-- them: with the payload files of live calls (payload_size), what a user keeps there counts
-- towards their storage limit (gateway/db.py: shared_usage). Only invocations with such a
-- file are indexed: that sum reads a few rows per user, not their whole history.
ALTER TABLE invocations ADD COLUMN result_size bigint NOT NULL DEFAULT 0;
CREATE INDEX invocations_shared_files ON invocations (owner_id)
    WHERE payload_file IS NOT NULL OR result_file IS NOT NULL;

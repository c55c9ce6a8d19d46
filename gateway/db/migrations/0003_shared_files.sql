-- Payloads and results may be files in the cluster's shared directory (the NAS), named
-- relative to its root (bulletin/payloads/..., bulletin/results/...).
ALTER TABLE invocations ADD COLUMN payload_file text, ADD COLUMN result_file text;
-- 0001's unnamed CHECK (payload IS NOT NULL OR payload_blob IS NOT NULL) got this name.
ALTER TABLE invocations DROP CONSTRAINT invocations_check;
ALTER TABLE invocations ADD CONSTRAINT invocations_payload_check
    CHECK (payload IS NOT NULL OR payload_blob IS NOT NULL OR payload_file IS NOT NULL);

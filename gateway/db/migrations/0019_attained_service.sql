-- Least attained service (docs/scheduling.md, "fair" in detail): the GPU-seconds of service a
-- call received in its runs so far, added each time it is queued again (preempted, handed
-- back, or its node lost), from when it got its GPUs. The fair policy ranks waiting calls by
-- it, and running ones by it plus their current run.
ALTER TABLE invocations ADD COLUMN attained_gpu_s double precision NOT NULL DEFAULT 0;

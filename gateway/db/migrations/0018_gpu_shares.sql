-- Calls asking for part of one GPU (docs/scheduling.md, "Part of a GPU"): gpus is 1 and
-- gpu_share the part (0 < share < 1); whole GPUs have gpu_share 1. Such calls share their
-- GPU: usage counts gpus * gpu_share.
ALTER TABLE invocations ADD COLUMN gpu_share double precision NOT NULL DEFAULT 1
    CHECK (gpu_share > 0 AND gpu_share <= 1 AND (gpu_share = 1 OR gpus = 1));
ALTER TABLE functions ADD COLUMN gpu_share double precision NOT NULL DEFAULT 1
    CHECK (gpu_share > 0 AND gpu_share <= 1 AND (gpu_share = 1 OR gpus = 1));

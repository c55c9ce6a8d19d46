-- Quotas per GPU model (Kueue's resource flavours): a group's GPUs of a model count against
-- its row here as well as against the group's own quota. A GPU belongs to the longest listed
-- model that is part of its model name, case-insensitive ("A100" takes "NVIDIA
-- A100-SXM4-80GB"). The group holds at most guaranteed_gpus + borrow_limit_gpus of them
-- (NULL: no limit), and those above guaranteed_gpus are borrowed: another group may reclaim
-- them (docs/scheduling.md).
CREATE TABLE group_model_quotas (
    group_name         text NOT NULL REFERENCES groups (name) ON DELETE CASCADE,
    model              text NOT NULL CHECK (length(model) BETWEEN 1 AND 64 AND model !~ '[|]'),
    guaranteed_gpus    integer NOT NULL DEFAULT 0 CHECK (guaranteed_gpus >= 0),
    borrow_limit_gpus  integer CHECK (borrow_limit_gpus >= 0),
    PRIMARY KEY (group_name, model)
);

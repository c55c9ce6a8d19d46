-- Scheduling: groups with quotas, per-call constraints and priority, preemption, and usage.
--
-- A group is the quota unit: guaranteed_gpus it can always get back (by preempting other
-- groups' borrowed work), and borrow_limit_gpus more it may use while they are idle (NULL: no
-- limit). Every user belongs to one group; users made before groups existed are in 'default'.
CREATE TABLE groups (
    name               text PRIMARY KEY,
    guaranteed_gpus    integer NOT NULL DEFAULT 0 CHECK (guaranteed_gpus >= 0),
    borrow_limit_gpus  integer CHECK (borrow_limit_gpus >= 0),
    created_at         timestamptz NOT NULL DEFAULT now()
);
INSERT INTO groups (name) VALUES ('default');
ALTER TABLE users ADD COLUMN group_name text NOT NULL DEFAULT 'default' REFERENCES groups (name);

-- What a call asks for besides a GPU count, and what the scheduler did with it: how often it
-- was preempted, when the node was told to stop it for preemption (NULL: not being
-- preempted), and why it waits (written by the leader for the calls it looked at). A call
-- placed above its group's guarantee is borrowed: another group may reclaim its GPUs.
ALTER TABLE invocations
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    ADD COLUMN gpu_model text,
    ADD COLUMN gpu_memory_mb integer,
    ADD COLUMN expected_s double precision,
    ADD COLUMN borrowed boolean NOT NULL DEFAULT false,
    ADD COLUMN preemptions integer NOT NULL DEFAULT 0,
    ADD COLUMN preempt_at timestamptz,
    ADD COLUMN preempt_reason text,
    ADD COLUMN queue_position integer,
    ADD COLUMN wait_reason text;

-- Accounting: GPU-seconds per user and day (group as it was then), accrued by the
-- scheduling leader for every running call; and the decayed usage fair share ranks by.
CREATE TABLE usage_daily (
    day          date NOT NULL,
    user_id      bigint NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    group_name   text NOT NULL,
    gpu_seconds  double precision NOT NULL DEFAULT 0,
    calls        bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (day, user_id, group_name)
);
-- Per group (user_name '') and per user within a group.
CREATE TABLE fair_usage (
    group_name   text NOT NULL,
    user_name    text NOT NULL,
    decayed_gpu_seconds double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (group_name, user_name)
);
-- When usage was last accrued (one row): each round adds what ran since.
CREATE TABLE usage_clock (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    accrued_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO usage_clock DEFAULT VALUES;
-- Accrual reads the calls that ended since its last run.
CREATE INDEX invocations_finished ON invocations (finished_at) WHERE finished_at IS NOT NULL;

-- Each round reads the head of every user's queue (fair share must see every group's work,
-- however long another group's backlog is).
CREATE INDEX invocations_queued_owner ON invocations (owner_id, seq) WHERE state = 'queued';

-- The warm workers each node reported last, as [{"owner": ..., "function": ...}]: among
-- equally good nodes the scheduler prefers one with a warm worker for the call.
ALTER TABLE nodes ADD COLUMN warm jsonb NOT NULL DEFAULT '[]';

-- When a call last entered the queue: NULL while it has never left it (submitted_at counts),
-- set each time it is queued again (preempted, handed back by a stopping node, or its node
-- lost). The fair policy's starvation guard counts a call's wait from here, so a call that
-- reclaim just sent back does not count its earlier runs as waiting (docs/scheduling.md).
ALTER TABLE invocations ADD COLUMN queued_at timestamptz;

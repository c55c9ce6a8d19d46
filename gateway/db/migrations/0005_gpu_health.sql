-- GPU health, as the node last reported it, and draining: a drained node gets no new work
-- (its running calls finish). A GPU reporting a critical error drains its node; so can an
-- admin (`bulletin node drain`), and only an admin undrains it.
ALTER TABLE nodes
    ADD COLUMN gpu_health jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN health_at timestamptz,
    ADD COLUMN draining boolean NOT NULL DEFAULT false,
    ADD COLUMN drain_reason text;

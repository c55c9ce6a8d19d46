-- Items of one map (SubmitRequest.map_id) and the slot leases they run in. A call placed
-- by the scheduler is its own lease (lease_id NULL: its id); the next items of its map that
-- a node is given when it completes one (gateway/db/slots.py) run in the same lease, one
-- after another, and the lease counts for the node's capacity once.
ALTER TABLE invocations ADD COLUMN map_id uuid, ADD COLUMN lease_id uuid;
-- What waits, by owner and map (a call that is no map's item is a map of its own): whether
-- anything but one map waits is two probes of it, and a map's next items one range of it.
CREATE INDEX invocations_queued_map ON invocations (owner_id, (coalesce(map_id, id)), seq)
  WHERE state = 'queued';

-- A user's storage (the sum of their blobs' sizes) is read at every blob upload and at
-- each of its chunks (gateway/db.py: blob_usage); deleting a user cascades to their blobs.
CREATE INDEX blobs_owner ON blobs (owner_id);

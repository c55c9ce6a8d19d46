-- Every start of a nodelet is a new incarnation of its node (DESIGN.md invariant 9): it
-- registers anew, which moves this number on and takes back what earlier incarnations held;
-- node routes refuse requests that name an earlier one (gateway/auth.py: node).
ALTER TABLE nodes ADD COLUMN incarnation bigint NOT NULL DEFAULT 0;

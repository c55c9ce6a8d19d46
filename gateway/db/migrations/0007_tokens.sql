-- Tokens can be listed, named, expire and be revoked. `hint` is the token's first characters
-- (its kind prefix and 6 more), enough to recognise it in a listing, never enough to use it.
ALTER TABLE tokens
    ADD COLUMN id bigserial UNIQUE,
    ADD COLUMN name text NOT NULL DEFAULT '',
    ADD COLUMN hint text NOT NULL DEFAULT '',
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN revoked_at timestamptz;

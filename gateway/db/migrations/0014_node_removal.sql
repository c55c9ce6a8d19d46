-- A node an admin removed (bulletin node remove): its tokens are revoked, it is not listed,
-- nothing is placed on it and it counts for no capacity. The row stays: attempts name it.
-- 'bulletin node add' of the same name brings it back (removed_at NULL again).
ALTER TABLE nodes ADD COLUMN removed_at timestamptz;

-- Schema version 8 -> 9: the completion time of a message, and the v2/v3 messages
-- kept past their TTL (see sqlite-v9.sql). Every message stored before has no
-- completion time (NULL).
ALTER TABLE messages ADD COLUMN completed_at REAL;
DROP INDEX messages_expiry;
CREATE INDEX messages_expiry ON messages (expires_at)
  WHERE expires_at IS NOT NULL AND (v2 IS NULL OR status IN ('queued', 'leased'));

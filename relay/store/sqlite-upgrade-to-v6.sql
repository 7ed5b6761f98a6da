-- Schema version 5 -> 6: the copies of a group send (REACH §13; see sqlite-v6.sql).
ALTER TABLE messages ADD COLUMN via TEXT;
ALTER TABLE messages ADD COLUMN sent_id TEXT;
CREATE INDEX messages_sent_id ON messages (sent_id) WHERE sent_id IS NOT NULL;

-- Schema version 7 -> 8: the priorities of REACH §14 and the role leases of §13
-- (see sqlite-v8.sql).
ALTER TABLE messages ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE messages ADD COLUMN holder TEXT;
CREATE INDEX messages_urgent ON messages (recipient, priority DESC, seq)
  WHERE status = 'queued' AND priority > 0;

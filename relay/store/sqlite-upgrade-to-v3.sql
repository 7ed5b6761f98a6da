-- Schema version 2 -> 3: the delivery extensions v1.2. Each message counts its
-- deliveries, may be held back (delay, retry-after), may carry its sender's TTL
-- and remembers why it failed; peers may carry a card. New indexes serve the
-- sent box, pull by parent, threads and the TTL sweep.
ALTER TABLE messages ADD COLUMN deliveries INTEGER NOT NULL DEFAULT 0;
ALTER TABLE messages ADD COLUMN not_before REAL;
ALTER TABLE messages ADD COLUMN dead_reason TEXT;
ALTER TABLE messages ADD COLUMN delay_until REAL;
ALTER TABLE messages ADD COLUMN expires_at REAL;
ALTER TABLE peers ADD COLUMN card TEXT;
CREATE INDEX messages_outbox ON messages (sender, status, seq);
CREATE INDEX messages_parent ON messages (parent_id, seq) WHERE parent_id IS NOT NULL;
CREATE INDEX messages_reply_to ON messages (reply_to, seq) WHERE reply_to IS NOT NULL;
CREATE INDEX messages_root ON messages (root_id, seq) WHERE root_id IS NOT NULL;
CREATE INDEX messages_expiry ON messages (expires_at) WHERE expires_at IS NOT NULL;

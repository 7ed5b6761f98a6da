-- Migration 2: the delivery extensions v1.2. Each message counts its
-- deliveries, may be held back (delay, retry-after), may carry its sender's TTL
-- and remembers why it failed; peers may carry a card. New indexes serve the
-- sent box, pull by parent, threads and the TTL sweep.
ALTER TABLE relay_messages
  ADD COLUMN deliveries integer NOT NULL DEFAULT 0,
  ADD COLUMN not_before double precision,    -- epoch s: neither pulled nor polled before
  ADD COLUMN dead_reason text,               -- attempts | deliveries | rejected | cancelled | expired
  ADD COLUMN delay_until double precision,   -- epoch s: the sender's delaySeconds, as sent
  ADD COLUMN expires_at double precision;    -- epoch s: the sender's ttlSeconds
ALTER TABLE relay_peers ADD COLUMN card text; -- JSON object, or NULL
CREATE INDEX relay_messages_outbox ON relay_messages (sender, seq);
CREATE INDEX relay_messages_parent ON relay_messages (parent_id, seq) WHERE parent_id IS NOT NULL;
CREATE INDEX relay_messages_reply_to ON relay_messages (reply_to, seq) WHERE reply_to IS NOT NULL;
CREATE INDEX relay_messages_root ON relay_messages (root_id, seq) WHERE root_id IS NOT NULL;
CREATE INDEX relay_messages_expiry ON relay_messages (expires_at) WHERE expires_at IS NOT NULL;

-- Migration 13: the completion time of a message, and the v2/v3 messages kept past
-- their TTL (WIRE-V2 §3). completed_at (epoch seconds) is when a message last became
-- done or failed; NULL for every message stored before. A seed-wire message is
-- removed when its TTL runs out; a v2/v3 one is kept until retention removes it, as
-- expired while it was queued or leased: it leaves relay_messages_expiry once done,
-- failed or expired, so the sweep never reads it again.
ALTER TABLE relay_messages ADD COLUMN completed_at double precision;
DROP INDEX relay_messages_expiry;
CREATE INDEX relay_messages_expiry ON relay_messages (expires_at)
  WHERE expires_at IS NOT NULL AND (v2 IS NULL OR status IN ('queued', 'leased'));

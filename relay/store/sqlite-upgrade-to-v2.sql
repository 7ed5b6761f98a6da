-- Schema version 1 -> 2: /v1/messages/query searches only the caller's inbox, so
-- nothing reads the per-sender index any more; each send stops paying for it.
DROP INDEX IF EXISTS messages_outbox;

-- Schema version 3 -> 4: the sent-box index loses its status column. Keyed by
-- (sender, status, seq), every lease and every settle moved the message's entry
-- (two pages written per sender per commit, a third of an ack's commit); the sent
-- box is read in one pass newest first instead, as the PostgreSQL store reads it,
-- and its dead letters from a partial index of the failed rows.
DROP INDEX messages_outbox;
CREATE INDEX messages_outbox ON messages (sender, seq);
CREATE INDEX messages_sent_failed ON messages (sender, seq) WHERE status = 'failed';

-- Schema version 3 -> 4: the sent-box index loses its status column. Keyed by
-- (sender, status, seq), every lease and every settle moved the message's entry
-- (two pages written per sender per commit, a third of an ack's commit); the sent
-- box is read in one pass newest first instead, as the PostgreSQL store reads it.
DROP INDEX messages_outbox;
CREATE INDEX messages_outbox ON messages (sender, seq);

-- Migration 3: the ops endpoints count dead letters per recipient at every scrape;
-- a partial index keeps that count to the failed rows.
CREATE INDEX relay_messages_failed ON relay_messages (recipient) WHERE status = 'failed';

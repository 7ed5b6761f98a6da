-- Migration 10: the copies of a group send (REACH §13). A copy keeps the
-- group's address (via, group:NAME) and the id its sender sent under (sent_id);
-- a repeated send and the status of that id find the copies by
-- relay_messages_sent_id, which holds only copies.
ALTER TABLE relay_messages ADD COLUMN via text, ADD COLUMN sent_id text;
CREATE INDEX relay_messages_sent_id ON relay_messages (sent_id) WHERE sent_id IS NOT NULL;

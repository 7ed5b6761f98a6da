-- Migration 6: a sender's dead letters (relay dead; a query of the sent box for
-- status "failed") are read from the failed rows alone, newest first, rather
-- than by walking the sender's whole sent box. Only failed rows are in it, so a
-- send, a pull or an ack writes nothing to it.
CREATE INDEX relay_messages_sent_failed ON relay_messages (sender, seq) WHERE status = 'failed';

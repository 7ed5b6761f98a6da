-- Migration 12: the priorities of REACH §14 and the role leases of §13.
-- priority is fixed at send (0..9); holder is the member that leased a role
-- message last. A pull reads each of its queues (an agent's, its roles') in the
-- order it leases, higher priority first, then by seq: relay_messages_ranked.
ALTER TABLE relay_messages ADD COLUMN priority integer NOT NULL DEFAULT 0,
  ADD COLUMN holder text;
CREATE INDEX relay_messages_ranked ON relay_messages (recipient, priority DESC, seq)
  WHERE status = 'queued';

-- Schema version 4 -> 5: the events of REACH §11 and the webhooks of §12 (see
-- sqlite-v5.sql).
CREATE TABLE events
(
  id INTEGER PRIMARY KEY,
  agent TEXT NOT NULL,
  at REAL NOT NULL,
  type TEXT NOT NULL,
  data TEXT NOT NULL
);
CREATE INDEX events_agent ON events (agent, id);
CREATE TABLE webhooks
(
  agent TEXT PRIMARY KEY,
  state TEXT NOT NULL
) WITHOUT ROWID;

-- REACH §11: the queued messages held back by a delay, whose end records their
-- message event (not_before is cleared then); only those rows are in it.
CREATE INDEX messages_held ON messages (not_before) WHERE status = 'queued' AND not_before IS NOT NULL;

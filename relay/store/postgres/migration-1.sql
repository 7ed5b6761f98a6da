-- Migration 1 of the relay's PostgreSQL store: messages, peers, lockouts.
-- Migrations run in order at start, each in the transaction that records it in
-- relay_schema, under an advisory lock (several brokers may start at once).

-- One row per stored message: the spec §2 envelope, the §5.1 delivery state and
-- the broker's bookkeeping. seq is the delivery order; a message's number is
-- taken under its recipient's advisory lock, so per recipient a lower seq is
-- never committed after a higher one (the v1.0 cursor never skips a message).
-- version counts the saves of a row: a save that finds another version lost a
-- race with another broker and is retried (optimistic locking).
CREATE TABLE relay_messages
(
  seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id text NOT NULL UNIQUE,             -- client-chosen; dedup and ack lookups
  sender text NOT NULL,                -- envelope "from"
  recipient text NOT NULL,             -- envelope "to"
  ts text NOT NULL,                    -- ISO-8601, as sent on the wire
  type text NOT NULL,
  body text NOT NULL,                  -- JSON object, kept as sent
  reply_to text,
  ack boolean NOT NULL,
  kind text NOT NULL,
  root_id text,
  parent_id text,
  status text NOT NULL,                -- queued | leased | done | failed
  attempts integer NOT NULL,
  lease_until bigint,                  -- epoch ms while leased
  lease_id text,
  error text,
  created double precision NOT NULL,   -- epoch seconds; message TTL
  recovery boolean NOT NULL DEFAULT false, -- due for the v1.0 recovery delivery
  version integer NOT NULL DEFAULT 0
) WITH (
  -- Rows are updated a few times each and then stay: vacuum the hot table
  -- early, so dead row versions of leases and acks do not pile up.
  autovacuum_vacuum_scale_factor = 0.02,
  autovacuum_analyze_scale_factor = 0.02,
  fillfactor = 90
);

-- The hot set is small even when the table is not: pull and poll read a partial
-- index of queued rows only, the lease sweep one of leased rows only, so done
-- and failed messages cost these paths nothing.
CREATE INDEX relay_messages_queued ON relay_messages (recipient, seq) WHERE status = 'queued';
CREATE INDEX relay_messages_leases ON relay_messages (lease_until) WHERE status = 'leased';
CREATE INDEX relay_messages_recovery ON relay_messages (recipient, seq) WHERE recovery;
-- recent and query read one agent's inbox, newest first, any status.
CREATE INDEX relay_messages_inbox ON relay_messages (recipient, seq);
-- The TTL sweep: messages are stored in time order, which a BRIN index
-- summarises in a few pages at almost no cost per insert.
CREATE INDEX relay_messages_created ON relay_messages USING brin (created);

CREATE TABLE relay_peers
(
  agent text PRIMARY KEY,
  last_seen bigint NOT NULL            -- epoch seconds of the last registration
);

-- Authentication failures counted for every broker, and the locks they caused.
CREATE TABLE relay_lockouts
(
  agent text PRIMARY KEY,
  failures integer NOT NULL,           -- consecutive failures since the last lock or success
  locked_until double precision,       -- epoch seconds
  updated double precision NOT NULL    -- epoch seconds of the last change
);

-- Schema version 4 of the relay's SQLite store (dataDir/relay.db).
-- A new database is created from the newest sqlite-vN.sql; an older one is
-- brought forward by sqlite-upgrade-to-vN.sql scripts, one version at a time
-- (the old full schemas are kept with the tests, which build old databases).

CREATE TABLE version
(
  version INTEGER NOT NULL
);

-- One row per stored message: the spec §2 envelope, the §5.1 delivery state
-- and the broker's bookkeeping. seq is the delivery order, assigned by the
-- store (not AUTOINCREMENT, whose bookkeeping row costs a page write per
-- commit); meta.last_seq keeps it monotonic after the newest messages expired.
CREATE TABLE messages
(
  seq INTEGER PRIMARY KEY,
  id TEXT NOT NULL UNIQUE,            -- client-chosen; dedup and ack lookups
  sender TEXT NOT NULL,               -- envelope "from"
  recipient TEXT NOT NULL,            -- envelope "to"
  ts TEXT NOT NULL,                   -- ISO-8601, as sent on the wire
  type TEXT NOT NULL,
  body TEXT NOT NULL,                 -- JSON object
  reply_to TEXT,
  ack INTEGER NOT NULL,               -- 0 or 1
  kind TEXT NOT NULL,
  root_id TEXT,
  parent_id TEXT,
  status TEXT NOT NULL,               -- queued | leased | done | failed
  attempts INTEGER NOT NULL,
  lease_until INTEGER,                -- epoch ms while leased
  lease_id TEXT,
  error TEXT,
  created REAL NOT NULL,              -- epoch seconds; message TTL
  recovery INTEGER NOT NULL DEFAULT 0, -- 1: due for the v1.0 recovery delivery
  deliveries INTEGER NOT NULL DEFAULT 0, -- leases granted
  not_before REAL,                    -- epoch seconds: held back until then
  dead_reason TEXT,                   -- why it failed: attempts | deliveries | rejected | cancelled
  delay_until REAL,                   -- epoch seconds: the sender's delaySeconds
  expires_at REAL                     -- epoch seconds: the sender's ttlSeconds
);

-- The indexes a new message enters are kept few: each one costs a page write per commit,
-- and the partial ones cost nothing to a message without the field.
-- poll and pull: the queued messages of one agent in order; recent and query
-- (the caller's inbox) read the newest of each status and merge them.
CREATE INDEX messages_inbox ON messages (recipient, status, seq);
-- query of the sent box: one read, newest first, the status filtered on the way.
-- Without the status in its key a pull or an ack (which change only the status)
-- leaves this index alone: one B-tree fewer per commit of every lease and settle.
CREATE INDEX messages_outbox ON messages (sender, seq);
-- the sender's dead letters (relay dead), found without walking the sent box:
-- only failed rows are in this index, so a pull or an ack writes nothing to it.
CREATE INDEX messages_sent_failed ON messages (sender, seq) WHERE status = 'failed';
-- the lease sweep: only leased rows are in this index.
CREATE INDEX messages_leases ON messages (lease_until) WHERE status = 'leased';
-- the v1.0 recovery deliveries: only marked rows are in this index.
CREATE INDEX messages_recovery ON messages (recipient, seq) WHERE recovery = 1;
-- pull by parent and query by parentId: a parent id or a reply-to.
CREATE INDEX messages_parent ON messages (parent_id, seq) WHERE parent_id IS NOT NULL;
CREATE INDEX messages_reply_to ON messages (reply_to, seq) WHERE reply_to IS NOT NULL;
-- threads and query by rootId.
CREATE INDEX messages_root ON messages (root_id, seq) WHERE root_id IS NOT NULL;
-- the expiry of messages sent with ttlSeconds.
CREATE INDEX messages_expiry ON messages (expires_at) WHERE expires_at IS NOT NULL;
-- The age sweep removes the oldest messages in seq order (the primary key).

CREATE TABLE peers
(
  agent TEXT PRIMARY KEY,
  last_seen INTEGER NOT NULL,         -- epoch seconds of the last registration
  card TEXT                           -- JSON object: the peer card, when one is registered
) WITHOUT ROWID;

-- Small counters of the store: last_seq, the highest seq ever removed.
CREATE TABLE meta
(
  key TEXT PRIMARY KEY,
  value INTEGER NOT NULL
) WITHOUT ROWID;

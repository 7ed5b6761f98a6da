-- Migration 5: the signed nonces (EXTENSIONS.md §9) every broker accepted, so that
-- the brokers sharing this database accept each (agent, nonce) once within the
-- skew window, as one broker does. A claim is one INSERT … ON CONFLICT on the
-- primary key; a row is dead once its request's timestamp is out of the window
-- (expires), and the expiry sweep every broker runs deletes the dead rows, so the
-- table holds a few minutes of nonce requests. Logged (unlike an UNLOGGED
-- table, it survives a crash of the server and reaches its replicas), though a
-- claim commits without waiting for its WAL flush.
CREATE TABLE relay_nonces
(
  agent text NOT NULL,
  nonce text NOT NULL,
  expires bigint NOT NULL,             -- epoch seconds: the request's timestamp + 300
  PRIMARY KEY (agent, nonce)
) WITH (
  -- Every row is inserted once and deleted minutes later: vacuum early.
  autovacuum_vacuum_scale_factor = 0.02,
  autovacuum_analyze_scale_factor = 0.02
);
CREATE INDEX relay_nonces_expires ON relay_nonces (expires);

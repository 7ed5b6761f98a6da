-- Migration 11: the v2/v3 wire's fields of a message sent on it (WIRE-V2 §3):
-- JSON text of its execution mode, session reference and shared-write grant;
-- NULL for a message sent on the seed wire, as every message stored before.
ALTER TABLE relay_messages ADD COLUMN v2 text;

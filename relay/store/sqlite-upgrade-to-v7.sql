-- Schema version 6 -> 7: the v2/v3 wire's fields of a message sent on it (see
-- sqlite-v7.sql); NULL for every message stored before, all sent on the seed wire.
ALTER TABLE messages ADD COLUMN v2 TEXT;

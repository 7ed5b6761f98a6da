-- Migration 4: inbox quotas. One row per recipient counts its pending (queued or
-- leased) messages and the UTF-8 bytes of their bodies, kept by the statements
-- that change them, so a send checks its recipient's quota with one key lookup.
CREATE TABLE relay_inbox_usage
(
  recipient text PRIMARY KEY,
  messages bigint NOT NULL,
  bytes bigint NOT NULL
);
INSERT INTO relay_inbox_usage (recipient, messages, bytes)
  SELECT recipient, count(*), coalesce(sum(octet_length(body)), 0) FROM relay_messages
  WHERE status IN ('queued', 'leased') GROUP BY recipient;

-- A recipient's usage, read under its advisory lock (the one a send to it takes)
-- so that a quota holds exactly across brokers. A function, because a statement
-- that waits for a lock still reads the snapshot it started with; each statement
-- of a volatile function takes a new one.
CREATE FUNCTION relay_inbox_usage_locked(lock_class integer, agent text,
                                         OUT messages bigint, OUT bytes bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  PERFORM pg_advisory_xact_lock(lock_class, hashtext(agent));
  SELECT u.messages, u.bytes INTO messages, bytes
    FROM relay_inbox_usage AS u WHERE u.recipient = agent;
END
$$;

"""The SQL of the postgres store: the columns a message is stored in, every
statement its operations run, and the listing statements built from filters."""

from __future__ import annotations

from typing import Mapping, Optional

from relay.store.columns import STATE, STORED, names
from relay.wire.protocol import STORED_STATUSES

CHANNEL = "relay_changes"

# Advisory lock keys (the two-int form): a class, then the key within it.
LOCK_CLASS_MIGRATION = 0x72656C00  # "rel\0"
LOCK_CLASS_RECIPIENT = 0x72656C01
LOCK_CLASS_EVENTS = 0x72656C02
# The most events one run of retention removes (the sweep runs again soon).
EVENT_TRIM_BATCH = 20_000

# -- rows -------------------------------------------------------------------------------

# The columns of a message (relay.store.columns, the table the SQL stores share),
# after its identity number and row version.
COLUMNS = names(STORED, lead=("seq", "version"))
_M_COLUMNS = names(STORED, lead=("seq", "version"), prefix="m.")

_SELECT = f"SELECT {COLUMNS} FROM relay_messages"
_PENDING = "('queued', 'leased')"
# What a row counts toward its recipient's inbox quota (delivery.Message.stored_bytes;
# migration 8): the UTF-8 bytes of its body and of the envelope strings its sender chose.
_STORED_BYTES = ("(octet_length(body) + octet_length(id) + octet_length(sender) "
                 "+ octet_length(recipient) + coalesce(octet_length(reply_to), 0) "
                 "+ coalesce(octet_length(root_id), 0) + coalesce(octet_length(parent_id), 0))")
# Adds the pending messages of ``rows`` (recipient, status, stored bytes) to their
# recipients' usage.
_COUNT = (
    "INSERT INTO relay_inbox_usage AS u (recipient, messages, bytes) "
    "SELECT recipient, 1, size FROM {rows} WHERE status IN " + _PENDING + " "
    "ON CONFLICT (recipient) DO UPDATE SET messages = u.messages + excluded.messages, "
    "bytes = u.bytes + excluded.bytes"
)
INSERT = (
    # The recipient's lock is taken before the row (and its identity number) is
    # made, and held until the transaction ends.
    "WITH recipient_lock AS (SELECT pg_advisory_xact_lock(%s, hashtext(%s))), "
    f"added AS (INSERT INTO relay_messages ({names(STORED)}) "
    f"SELECT {', '.join(f'%s::{c.sql_type}' for c in STORED)} FROM recipient_lock "
    "ON CONFLICT (id) DO NOTHING "
    f"RETURNING seq, recipient, status, {_STORED_BYTES} AS size), "
    f"counted AS ({_COUNT.format(rows='added')}) "
    "SELECT seq FROM added"
)
# Changes of pending messages to recipients' usage: (recipients, message deltas,
# byte deltas), one entry per recipient.
_USAGE_DELTA = (
    "INSERT INTO relay_inbox_usage AS u (recipient, messages, bytes) "
    "SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) "
    "ON CONFLICT (recipient) DO UPDATE SET messages = u.messages + excluded.messages, "
    "bytes = u.bytes + excluded.bytes"
)
SAVE = (
    "UPDATE relay_messages AS m SET "
    + ", ".join(f"{c.name} = v.{c.name}" for c in STATE)
    + ", version = m.version + 1 FROM unnest(%s::bigint[], %s::integer[], "
    + ", ".join(f"%s::{c.sql_type}[]" for c in STATE)
    + f") AS v(seq, version, {names(STATE)}) "
    "WHERE m.seq = v.seq AND m.version = v.version"
)
# The lease of delivery.lease, given to up to ``limit`` queued messages at once.
# Deliverable at now: not held back and not past its TTL (relay.rules.delivery.deliverable).
_DUE = ("(not_before IS NULL OR not_before <= %(now)s) "
        "AND (expires_at IS NULL OR expires_at > %(now)s)")
_LIVE = "(expires_at IS NULL OR expires_at > %(now)s)"
# The condition of relay_messages_expiry besides a TTL (migration 13).
_EXPIRING = "(v2 IS NULL OR status IN ('queued', 'leased'))"
_PARENT = "(parent_id = %(parent)s OR reply_to = %(parent)s)"
# Each queue of the pull (the agent's, its roles': REACH §13) read in the order a
# pull leases (relay.rules.delivery.rank: higher priority first, then seq) on
# relay_messages_ranked, locked, skipping rows another broker holds; the first
# ``limit`` of them all by rank are leased. A role message records its holder.
_CLAIM = (
    "WITH candidates AS ("
    " SELECT c.seq, c.priority FROM unnest(%(queues)s::text[]) AS q (recipient)"
    " CROSS JOIN LATERAL (SELECT seq, priority FROM relay_messages AS r"
    "  WHERE r.recipient = q.recipient AND status = 'queued'"
    f"  AND {_DUE} {{parent}} ORDER BY priority DESC, seq LIMIT %(limit)s"
    " FOR UPDATE SKIP LOCKED) AS c"
    " ORDER BY c.priority DESC, c.seq LIMIT %(limit)s"
    "), numbered AS ("
    " SELECT seq, row_number() OVER (ORDER BY priority DESC, seq) AS n FROM candidates"
    ") UPDATE relay_messages AS m SET status = 'leased',"
    " lease_id = (%(lease_ids)s::text[])[numbered.n], lease_until = %(until)s,"
    " recovery = false, deliveries = m.deliveries + 1, not_before = NULL,"
    " holder = CASE WHEN left(m.recipient, 5) = 'role:' THEN %(agent)s ELSE m.holder END,"
    " version = m.version + 1"
    f" FROM numbered WHERE m.seq = numbered.seq RETURNING {_M_COLUMNS}"
)

_RANKED = (f"SELECT {_M_COLUMNS} FROM unnest(%(queues)s::text[]) AS q (recipient)"
           " CROSS JOIN LATERAL (SELECT * FROM relay_messages AS r"
           "  WHERE r.recipient = q.recipient AND status = 'queued'"
           f"  AND {_DUE} {{parent}} ORDER BY priority DESC, seq LIMIT %(limit)s) AS m"
           " ORDER BY m.priority DESC, m.seq LIMIT %(limit)s")

STATEMENTS = {
    "insert": INSERT,
    "get": f"{_SELECT} WHERE id = %s",
    "seq_of": "SELECT seq FROM relay_messages WHERE id = %s",
    "copies": f"{_SELECT} WHERE sent_id = %s ORDER BY seq",
    "save": SAVE,
    "claim": _CLAIM.format(parent=""),
    # by parent: the few answers of a message, found by their own indexes
    "claim_parent": _CLAIM.format(parent=f"AND {_PARENT}"),
    # the same read without leasing (the generic pull of relay.store.records)
    "ranked": _RANKED.format(parent=""),
    "ranked_parent": _RANKED.format(parent=f"AND {_PARENT}"),
    "card": "SELECT card FROM relay_peers WHERE agent = %s",
    # REACH §13 selfJoin: the agents whose card lists a role (a card is small JSON text)
    "joiners": ("SELECT agent FROM relay_peers WHERE card IS NOT NULL "
                "AND card::jsonb -> 'roles' ? %s ORDER BY agent"),
    "queued": (f"{_SELECT} WHERE recipient = %(agent)s AND status = 'queued' "
               f"AND seq > %(after)s AND {_DUE} ORDER BY seq LIMIT %(limit)s"),
    "queued_parent": (f"{_SELECT} WHERE recipient = %(agent)s AND status = 'queued' "
                      f"AND seq > %(after)s AND {_DUE} AND {_PARENT} ORDER BY seq LIMIT %(limit)s"),
    "recovered": (f"{_SELECT} WHERE recipient = %(agent)s AND recovery AND seq <= %(upto)s "
                  f"AND status = 'queued' AND {_DUE} ORDER BY seq LIMIT %(limit)s"),
    "thread": (f"{_SELECT} WHERE (id = %(root)s OR root_id = %(root)s) AND seq > %(after)s "
               f"AND (sender = %(agent)s OR recipient = %(agent)s) AND {_LIVE} "
               "ORDER BY seq LIMIT %(limit)s"),
    # Locked, skipping rows another transaction holds: overlapping sweeps and
    # reads on several brokers each release a lapsed lease once.
    "lapsed": (f"{_SELECT} WHERE status = 'leased' AND lease_until <= %s "
               "ORDER BY lease_until FOR UPDATE SKIP LOCKED"),
    # Delays that ended (REACH §11): locked and skipped like lapsed leases, so each
    # is released, and its event recorded, by one broker.
    "held_due": (f"{_SELECT} WHERE status = 'queued' AND not_before IS NOT NULL "
                 "AND not_before <= %s ORDER BY not_before LIMIT %s FOR UPDATE SKIP LOCKED"),
    # Locked, skipping rows another sweep holds: each expired row is removed (and
    # its failure notice stored) by one broker. A v2/v3 message whose TTL ran out
    # while queued or leased is read instead, to be kept as expired
    # (relay_messages_expiry holds no other v2/v3 message: its condition is written
    # here as it is written there).
    "expire": (
        "WITH doomed AS (SELECT seq FROM relay_messages WHERE created < %s OR "
        f"(expires_at <= %s AND {_EXPIRING} AND v2 IS NULL) "
        "LIMIT %s FOR UPDATE SKIP LOCKED) DELETE FROM relay_messages AS m USING doomed "
        f"WHERE m.seq = doomed.seq RETURNING {_M_COLUMNS}"
    ),
    "expire_kept": (
        f"{_SELECT} WHERE expires_at <= %s AND {_EXPIRING} AND v2 IS NOT NULL "
        "AND created >= %s LIMIT %s FOR UPDATE SKIP LOCKED"
    ),
    "register": (
        "INSERT INTO relay_peers AS p (agent, last_seen) VALUES (%s, %s) "
        "ON CONFLICT (agent) DO UPDATE SET last_seen = greatest(p.last_seen, excluded.last_seen)"
    ),
    "register_card": (
        "INSERT INTO relay_peers AS p (agent, last_seen, card) VALUES (%s, %s, %s) "
        "ON CONFLICT (agent) DO UPDATE SET "
        "last_seen = greatest(p.last_seen, excluded.last_seen), card = excluded.card"
    ),
    "is_registered": "SELECT 1 FROM relay_peers WHERE agent = %s",
    # Under the recipient's lock (the one a send to it takes), read after the lock
    # is granted, so the quota holds exactly across brokers (migration 4).
    "usage": "SELECT messages, bytes FROM relay_inbox_usage_locked(%s, %s)",
    "usage_delta": _USAGE_DELTA,
    "agent_count": "SELECT count(*) FROM relay_peers",
    "forget": (
        "DELETE FROM relay_peers AS p WHERE last_seen < %s AND NOT EXISTS "
        "(SELECT 1 FROM relay_messages AS m WHERE m.recipient = p.agent "
        "AND m.status <> 'expired') RETURNING agent"
    ),
    "forget_usage": "DELETE FROM relay_inbox_usage WHERE recipient = ANY(%s::text[])",
    # Per recipient and state, each part on its state's partial index: never the
    # done messages (the metrics ask at every scrape).
    "depths": (
        "SELECT recipient, 'queued', coalesce(not_before > %(now)s, false), count(*), "
        "min(created) FROM relay_messages WHERE status = 'queued' GROUP BY 1, 3 "
        "UNION ALL SELECT recipient, 'leased', false, count(*), NULL FROM relay_messages "
        "WHERE status = 'leased' GROUP BY 1 "
        "UNION ALL SELECT recipient, 'failed', false, count(*), NULL FROM relay_messages "
        "WHERE status = 'failed' GROUP BY 1"
    ),
    # Some agents' messages in every state (the signed v2 /healthz), from the inbox index.
    "depths_settled": (
        "SELECT recipient, status, coalesce(status = 'queued' AND not_before > %(now)s, "
        "false), count(*), min(created) FILTER (WHERE status = 'queued') "
        "FROM relay_messages WHERE recipient = ANY(%(agents)s) GROUP BY 1, 2, 3"
    ),
    "peers": "SELECT agent, last_seen, card FROM relay_peers ORDER BY agent",
    "notify": "SELECT pg_notify(%s, %s)",
    # REACH §11. An agent's events are written under its transaction lock, taken
    # in name order (two transactions never wait for each other in a cycle).
    "event_lock": "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
    "webhooks": "SELECT agent, state FROM relay_webhooks",
    "webhook_put": (
        "INSERT INTO relay_webhooks (agent, state) VALUES (%s, %s) "
        "ON CONFLICT (agent) DO UPDATE SET state = excluded.state"
    ),
    "webhook_drop": "DELETE FROM relay_webhooks WHERE agent = %s",
    "webhook_lock": "SELECT state FROM relay_webhooks WHERE agent = %s FOR UPDATE",
    "event_insert": (
        "INSERT INTO relay_events (agent, at, type, data) "
        "SELECT agent, at, type, data FROM unnest(%s::text[], %s::float8[], %s::text[], "
        "%s::text[]) WITH ORDINALITY AS e (agent, at, type, data, n) ORDER BY n"
    ),
    "events_after": (
        "SELECT id, type, data, at FROM relay_events WHERE agent = %s AND id > %s "
        "ORDER BY id LIMIT %s"
    ),
    "event_marks": (
        "SELECT coalesce((SELECT value FROM relay_event_marks WHERE key = 'floor'), 0), "
        "coalesce((SELECT max(id) FROM relay_events WHERE agent = %s), 0)"
    ),
    # Retention: a batch of the oldest events above the floor; up to the batch's
    # newest, all but each agent's newest (its anchor, for kept_after) go, older
    # anchors of those agents too. The first such trim notes the floor it started
    # from ('anchored': events below it were removed without anchors).
    "event_trim": (
        "WITH f AS (SELECT coalesce((SELECT value FROM relay_event_marks "
        "WHERE key = 'floor'), 0) AS floor), "
        # (the oldest kept event first: when it is not old enough, nothing is read)
        "batch AS (SELECT id, agent FROM relay_events WHERE at < %(cutoff)s "
        "AND id > (SELECT floor FROM f) AND (SELECT at FROM relay_events "
        "WHERE id > (SELECT floor FROM f) ORDER BY id LIMIT 1) < %(cutoff)s "
        "ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED), "
        "newest AS (SELECT agent, max(id) AS id FROM batch GROUP BY agent), "
        # (arrays, so that each delete searches an index instead of reading the table)
        "gone AS (DELETE FROM relay_events WHERE id = ANY (ARRAY(SELECT id FROM batch "
        "EXCEPT SELECT id FROM newest))), "
        "superseded AS (DELETE FROM relay_events WHERE agent = ANY (ARRAY(SELECT agent "
        "FROM newest)) AND id <= (SELECT floor FROM f)), "
        "anchored AS (INSERT INTO relay_event_marks (key, value) "
        "SELECT 'anchored', floor FROM f WHERE EXISTS (SELECT 1 FROM batch) "
        "ON CONFLICT (key) DO NOTHING) "
        "INSERT INTO relay_event_marks AS m (key, value) "
        "SELECT 'floor', max(id) FROM batch HAVING count(*) > 0 "
        "ON CONFLICT (key) DO UPDATE SET value = greatest(m.value, excluded.value) "
        "RETURNING (SELECT count(*) FROM batch)"
    ),
    "event_kept_after": (
        "SELECT (SELECT value FROM relay_event_marks WHERE key = 'anchored'), "
        "coalesce((SELECT max(id) FROM relay_events WHERE agent = %s AND id <= %s), 0)"
    ),
    "lapsed_agents": (
        "SELECT DISTINCT recipient FROM relay_messages WHERE status = 'leased' "
        "AND lease_until <= %s"
    ),
    # The next deadline of each agent (a lease running out, a delay ending): what the
    # notifications missed while the LISTEN connection was down would have said.
    "upcoming": (
        "SELECT recipient, min(lease_until) / 1000.0 FROM relay_messages "
        "WHERE status = 'leased' AND lease_until > %(now_ms)s GROUP BY recipient "
        "UNION ALL SELECT recipient, min(not_before) FROM relay_messages "
        "WHERE status = 'queued' AND not_before > %(now)s GROUP BY recipient"
    ),
    # Every agent with a queued message, one index probe per agent (a loose index scan).
    "queued_agents": (
        "WITH RECURSIVE agents (recipient) AS ("
        " (SELECT recipient FROM relay_messages WHERE status = 'queued' ORDER BY recipient LIMIT 1)"
        " UNION ALL SELECT (SELECT m.recipient FROM relay_messages AS m"
        "  WHERE m.status = 'queued' AND m.recipient > a.recipient ORDER BY m.recipient LIMIT 1)"
        " FROM agents AS a WHERE a.recipient IS NOT NULL"
        ") SELECT recipient FROM agents WHERE recipient IS NOT NULL"
    ),
    # One failure of an agent from every address: a period older than the lock
    # time starts again.
    "lockout_spread": (
        "INSERT INTO relay_lockouts AS l (agent, source, failures, locked_until, updated, failed) "
        "VALUES (%(agent)s, '*', 1, NULL, %(now)s, %(now)s) ON CONFLICT (agent, source) DO UPDATE "
        "SET failures = CASE WHEN coalesce(l.failed, l.updated) <= %(period)s THEN 1 "
        "ELSE l.failures + 1 END, "
        "failed = CASE WHEN coalesce(l.failed, l.updated) <= %(period)s THEN %(now)s "
        "ELSE l.failed END, updated = excluded.updated RETURNING failures, failed"
    ),
    "lockout_failed": (
        "INSERT INTO relay_lockouts AS l (agent, source, failures, locked_until, updated, failed) "
        "VALUES (%(agent)s, %(address)s, 1, NULL, %(now)s, %(now)s) "
        "ON CONFLICT (agent, source) DO UPDATE "
        "SET failures = l.failures + 1, updated = excluded.updated, failed = excluded.failed "
        "RETURNING failures"
    ),
    # How many addresses an agent's failures came from since the period's start.
    "lockout_addresses": (
        "SELECT count(*) FROM relay_lockouts WHERE agent = %s AND source <> '*' AND failed >= %s"
    ),
    "lockout_lock": (
        "UPDATE relay_lockouts SET failures = 0, locked_until = %s, updated = %s "
        "WHERE agent = %s AND source = %s"
    ),
    # A lock this broker decided on its own count: it holds on every broker.
    "lockout_impose": (
        "INSERT INTO relay_lockouts AS l (agent, source, failures, locked_until, updated) "
        "VALUES (%s, %s, 0, %s, %s) ON CONFLICT (agent, source) DO UPDATE SET failures = 0, "
        "locked_until = greatest(l.locked_until, excluded.locked_until), "
        "updated = excluded.updated"
    ),
    "lockout_reset": (
        "UPDATE relay_lockouts SET failures = 0, updated = %s WHERE agent = %s AND source = %s"
    ),
    "lockout_unlock": "DELETE FROM relay_lockouts WHERE agent = %s",
    "lockout_load": "SELECT agent, source, failures, locked_until FROM relay_lockouts",
    "lockout_forget": (
        "DELETE FROM relay_lockouts WHERE updated < %s "
        "AND (locked_until IS NULL OR locked_until < %s)"
    ),
    # The first use of a nonce inserts its row, a use after the window replaces the
    # dead row (not swept yet), a replay returns nothing. The claim commits without
    # waiting for its WAL flush: the operation of a request that writes commits
    # after it, which flushes it too.
    "nonce_claim": (
        "WITH quick AS (SELECT set_config('synchronous_commit', 'off', true)) "
        "INSERT INTO relay_nonces AS n (agent, nonce, expires) SELECT %s, %s, %s FROM quick "
        "ON CONFLICT (agent, nonce) DO UPDATE SET expires = excluded.expires "
        "WHERE n.expires < %s RETURNING 1"
    ),
    # The same claim, and the agent's lock in force for the request's address (or
    # its own), in one statement: the lock another broker set just now holds here
    # before its notification arrives.
    "nonce_claim_locked": (
        "WITH quick AS (SELECT set_config('synchronous_commit', 'off', true)), "
        "claimed AS (INSERT INTO relay_nonces AS n (agent, nonce, expires) "
        "SELECT %(agent)s, %(nonce)s, %(expires)s FROM quick "
        "ON CONFLICT (agent, nonce) DO UPDATE SET expires = excluded.expires "
        "WHERE n.expires < %(now)s RETURNING 1) "
        "SELECT (SELECT count(*) FROM claimed), l.source, l.locked_until "
        "FROM (SELECT 1) AS one LEFT JOIN LATERAL (SELECT source, locked_until "
        "FROM relay_lockouts WHERE agent = %(agent)s AND source IN (%(address)s, '*') "
        "AND locked_until > %(now)s ORDER BY locked_until DESC LIMIT 1) AS l ON true"
    ),
    "nonce_forget": "DELETE FROM relay_nonces WHERE expires < %s",
}


_BOXES = {"inbox": "recipient = %(agent)s", "sent": "sender = %(agent)s",
          "all": "(recipient = %(agent)s OR sender = %(agent)s)"}
FILTERS = (("status", "status = %(status)s"), ("from", "sender = %(from)s"),
            ("to", "recipient = %(to)s"), ("kind", "kind = %(kind)s"),
            ("rootId", "(id = %(rootId)s OR root_id = %(rootId)s)"),
            ("parentId", "(parent_id = %(parentId)s OR reply_to = %(parentId)s)"))


# A known status is written into the statement rather than bound: the planner then
# knows the status and may read an index of that status alone (a sender's dead
# letters from relay_messages_sent_failed). Any other value is bound and matches nothing.
_STATUS_CLAUSES = {status: f"status = '{status}'" for status in STORED_STATUSES}
# The rows a listing with a match reads at a time (newest first, below the last read).
MATCH_PAGE = 200


def listing_statement(box: str, filters: Mapping[str, Optional[str]],
                       match: bool = False) -> str:
    """The SELECT of one box of an agent narrowed by the filters that are set, and to
    the messages whose TTL has not run out; with ``match``, a page of it below the
    seq ``before`` instead, whatever the TTL (the match decides)."""
    where = [_BOXES[box]]
    for name, clause in FILTERS:
        value = filters.get(name)
        if value is not None:
            where.append(_STATUS_CLAUSES.get(value, clause) if name == "status" else clause)
    where.append("seq < %(before)s" if match else _LIVE)
    return f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT %(limit)s"

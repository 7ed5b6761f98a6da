"""The PostgreSQL backend (``broker.storage: postgres``): one database, several brokers.

Several brokers behind a load balancer share one database; each is an ordinary
broker whose store is that database. The operations are those of
:mod:`relay.store.records`, run over :class:`PostgresRecords` (primitives bound
to one transaction) in a worker thread, so the reactor never waits for the
database and the delivery rules stay written once. What must hold across
brokers is done in SQL:

- **Pull** claims its messages in one statement: the locking
  ``SELECT … FOR UPDATE SKIP LOCKED`` in a ``WITH`` query, joined to the
  ``UPDATE … RETURNING`` that leases them (not ``WHERE seq IN (subquery)``,
  which may claim more rows than the limit: PostgreSQL bug #15715). Two brokers
  never lease one message at once; lapsed leases are released first, by the
  rules of :mod:`relay.rules.delivery`, in the same transaction.
- **Sequence numbers** are taken under a transaction-scoped advisory lock on the
  recipient: the next number for an agent is taken only after the previous
  transaction that took one for that agent has ended, so a lower number never
  becomes visible after a higher one and the v1.0 cursor (the last message id)
  never skips a message.
- **Every other read-modify-write** (acks, lease releases, the v1.0 recovery
  mark) is optimistic: each row has a ``version``; a save that finds another
  version lost a race with another broker, and the whole operation is run
  again on fresh rows.
- **Signed nonces** (EXTENSIONS.md §9) are claimed in ``relay_nonces`` by one
  ``INSERT … ON CONFLICT`` on ``(agent, nonce)`` (a row whose window is over
  counts as absent), so the brokers accept each nonce once between them; the
  expiry sweep deletes the rows whose window is over.
- **Wake-ups** cross brokers by ``LISTEN/NOTIFY``: a transaction that changes
  what waiters wait for sends one notification (the agents concerned, and lease
  deadlines) that commits with it; every other broker turns it into the same
  :class:`relay.rules.delivery.Changes` its own writes give, lease deadlines included,
  so a broker wakes its waiters at a deadline another broker set. One dedicated
  autocommit connection per broker listens, reconnecting by itself.
  Notifications are lost only while it is down: then a fallback look every
  ``FALLBACK_SECONDS``, and one after it is back, wake every agent with a
  queued message or a lapsed lease; after it is back, the next lease deadline
  and delay end of every agent are read again too.

Connections: ``poolSize`` worker threads, each with its own connection, opened
when first needed and again after it broke. A request that meets a broken
database gets ``503 busy``; an operation that failed before its ``COMMIT`` was
sent is retried once on a fresh connection (nothing of it was committed), and
one whose ``COMMIT`` got no answer is not (it may have committed). Statements,
connects and silent networks are bounded by timeouts, so nothing waits longer
than ``OPERATION_SECONDS``.

The schema is created and migrated at start by the numbered scripts
``migration-N.sql`` in one transaction each, under an advisory lock,
so several brokers may start at once. The psycopg 3 driver is imported only
when this backend is opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.interfaces import IReactorThreads, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from relay.rules import delivery
from relay.rules.auth import AGENT_LOCK_ADDRESSES, EVERY_ADDRESS
from relay.rules.config import Config, Setting, check_keys, read_settings, table_keys
from relay.rules.delivery import Changes, Message, Rules, Transition, WithStored
from relay.rules.events import ALL_AGENTS, Event
from relay.store import records as ops
from relay.store.interface import IMessageStore, ISharedLockouts, ISharedNonces, QueueDepth
from relay.store.records import EXPIRE_BATCH, Records
from relay.wire import errors
from relay.wire.errors import ConfigError, RelayError
from relay.wire.protocol import EXPIRED, KEEP_CARD, MAX_CLOCK_SKEW_SECONDS, QUEUED, STORED_STATUSES

log = Logger(namespace="relay.store.postgres")

SCHEMA_VERSION = 13
CHANNEL = "relay_changes"
# The package is not on the index: name the driver itself (the postgres extra).
INSTALL_HINT = "pip install 'psycopg[binary]>=3.2' in the broker's environment"

DEFAULT_POOL_SIZE = 10
STATEMENT_TIMEOUT_MS = 5000
OPERATION_SECONDS = 10.0
FALLBACK_SECONDS = 1.0
LISTEN_PROBE_SECONDS = 2.0
LISTEN_WAIT_SECONDS = 0.2
LISTEN_START_SECONDS = 5.0
RECONNECT_SECONDS = (0.2, 0.5, 1.0, 2.0)
MAX_TRIES = 8
NOTIFY_BYTES = 7900  # PostgreSQL's limit is 8000 bytes per payload
LOCKOUT_FORGET_SECONDS = 86400.0
LOCKOUT_SWEEP_SECONDS = 60.0

# Advisory lock keys (the two-int form): a class, then the key within it.
_LOCK_CLASS_MIGRATION = 0x72656C00  # "rel\0"
_LOCK_CLASS_RECIPIENT = 0x72656C01
_LOCK_CLASS_EVENTS = 0x72656C02
# The most events one run of retention removes (the sweep runs again soon).
EVENT_TRIM_BATCH = 20_000

# Connection settings the broker needs; any of them set in the dsn wins.
CONNECTION_DEFAULTS = {
    "application_name": "dsh-agent-relay",
    "connect_timeout": "3",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "3",
    "keepalives_count": "3",
    "tcp_user_timeout": "5000",
}

# -- rows -------------------------------------------------------------------------------

# (column, Message attribute, SQL type) of what a message is stored with, the
# delivery state last, in the order of Message.state(). A new field is one
# entry here and one migration.
ENVELOPE_COLUMNS: Tuple[Tuple[str, str, str], ...] = (
    ("id", "id", "text"),
    ("sender", "sender", "text"),
    ("recipient", "to", "text"),
    ("ts", "ts", "text"),
    ("type", "type", "text"),
    ("body", "body_json", "text"),
    ("reply_to", "reply_to", "text"),
    ("ack", "ack", "boolean"),
    ("kind", "kind", "text"),
    ("root_id", "root_id", "text"),
    ("parent_id", "parent_id", "text"),
    ("created", "created", "double precision"),
    ("delay_until", "delay_until", "double precision"),
    ("via", "via", "text"),
    ("sent_id", "sent_id", "text"),
    ("v2", "v2", "text"),
    ("priority", "priority", "integer"),
)
STATE_COLUMNS: Tuple[Tuple[str, str, str], ...] = (
    ("status", "status", "text"),
    ("attempts", "attempts", "integer"),
    ("lease_until", "lease_until", "bigint"),
    ("lease_id", "lease_id", "text"),
    ("error", "error", "text"),
    ("recovery", "recovery", "boolean"),
    ("deliveries", "deliveries", "integer"),
    ("not_before", "not_before", "double precision"),
    ("dead_reason", "dead_reason", "text"),
    ("holder", "holder", "text"),
    ("completed_at", "completed_at", "double precision"),
    ("expires_at", "expires_at", "double precision"),
)
_STORED = ENVELOPE_COLUMNS + STATE_COLUMNS
COLUMNS = ", ".join(["seq", "version"] + [c for c, _, _ in _STORED])
_M_COLUMNS = ", ".join(f"m.{c}" for c in ["seq", "version"] + [c for c, _, _ in _STORED])

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
_INSERT = (
    # The recipient's lock is taken before the row (and its identity number) is
    # made, and held until the transaction ends.
    "WITH recipient_lock AS (SELECT pg_advisory_xact_lock(%s, hashtext(%s))), "
    f"added AS (INSERT INTO relay_messages ({', '.join(c for c, _, _ in _STORED)}) "
    f"SELECT {', '.join(f'%s::{t}' for _, _, t in _STORED)} FROM recipient_lock "
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
_SAVE = (
    "UPDATE relay_messages AS m SET "
    + ", ".join(f"{c} = v.{c}" for c, _, _ in STATE_COLUMNS)
    + ", version = m.version + 1 FROM unnest(%s::bigint[], %s::integer[], "
    + ", ".join(f"%s::{t}[]" for _, _, t in STATE_COLUMNS)
    + f") AS v(seq, version, {', '.join(c for c, _, _ in STATE_COLUMNS)}) "
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
    f"  AND {_DUE} {{parent}} ORDER BY {{order}} LIMIT %(limit)s FOR UPDATE SKIP LOCKED) AS c"
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
           f"  AND {_DUE} {{parent}} ORDER BY {{order}} LIMIT %(limit)s) AS m"
           " ORDER BY m.priority DESC, m.seq LIMIT %(limit)s")

STATEMENTS = {
    "insert": _INSERT,
    "get": f"{_SELECT} WHERE id = %s",
    "seq_of": "SELECT seq FROM relay_messages WHERE id = %s",
    "copies": f"{_SELECT} WHERE sent_id = %s ORDER BY seq",
    "save": _SAVE,
    "claim": _CLAIM.format(parent="", order="priority DESC, seq"),
    # by parent: the few answers of a message, found by their own indexes
    "claim_parent": _CLAIM.format(parent=f"AND {_PARENT}", order="seq"),
    # the same read without leasing (the generic pull of relay.store.records)
    "ranked": _RANKED.format(parent="", order="priority DESC, seq"),
    "ranked_parent": _RANKED.format(parent=f"AND {_PARENT}", order="seq"),
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
_FILTERS = (("status", "status = %(status)s"), ("from", "sender = %(from)s"),
            ("to", "recipient = %(to)s"), ("kind", "kind = %(kind)s"),
            ("rootId", "(id = %(rootId)s OR root_id = %(rootId)s)"),
            ("parentId", "(parent_id = %(parentId)s OR reply_to = %(parentId)s)"))


# A known status is written into the statement rather than bound: the planner then
# knows the status and may read an index of that status alone (a sender's dead
# letters from relay_messages_sent_failed). Any other value is bound and matches nothing.
_STATUS_CLAUSES = {status: f"status = '{status}'" for status in STORED_STATUSES}
# The rows a listing with a match reads at a time (newest first, below the last read).
MATCH_PAGE = 200


def _listing_statement(box: str, filters: Mapping[str, Optional[str]],
                       match: bool = False) -> str:
    """The SELECT of one box of an agent narrowed by the filters that are set, and to
    the messages whose TTL has not run out; with ``match``, a page of it below the
    seq ``before`` instead, whatever the TTL (the match decides)."""
    where = [_BOXES[box]]
    for name, clause in _FILTERS:
        value = filters.get(name)
        if value is not None:
            where.append(_STATUS_CLAUSES.get(value, clause) if name == "status" else clause)
    where.append("seq < %(before)s" if match else _LIVE)
    return f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT %(limit)s"


def _message(row: Sequence[Any]) -> Message:
    values = dict(zip((a for _, a, _ in _STORED), row[2:]))
    return Message(seq=row[0], **values)


def _insert_values(message: Message) -> List[Any]:
    return [message.body_json() if a == "body_json" else getattr(message, a) for _, a, _ in _STORED]


class Conflict(Exception):
    """A row changed under this transaction (another broker won a race): run it again."""


class Unavailable(Exception):
    """The database cannot be reached or did not answer in time."""


# -- the primitives --------------------------------------------------------------------


class PostgresRecords(Records):
    """The :class:`Records` primitives as statements of one transaction (one cursor).

    Remembers the ``version`` of every row it hands out; :meth:`save` writes a
    row only at that version and raises :class:`Conflict` otherwise.
    """

    def __init__(self, cursor: Any) -> None:
        super().__init__()
        self.cursor = cursor
        self.versions: Dict[int, int] = {}
        self.registered: Set[str] = set()
        self.notice: Dict[str, Any] = {}
        # events of this transaction, written by finish() in one statement
        self.new_events: List[Tuple[str, str, str, float]] = []

    def _rows(self, sql: str, params: Sequence[Any]) -> List[Message]:
        self.cursor.execute(sql, params)
        out = []
        for row in self.cursor.fetchall():
            self.versions[row[0]] = row[1]
            out.append(_message(row))
        return out

    def insert(self, message: Message) -> bool:
        params = [_LOCK_CLASS_RECIPIENT, message.to] + _insert_values(message)
        self.cursor.execute(_INSERT, params)
        row = self.cursor.fetchone()
        if row is None:
            return False
        message.seq = row[0]
        self.versions[row[0]] = 0
        return True

    def get(self, message_id: str) -> Optional[Message]:
        found = self._rows(STATEMENTS["get"], (message_id,))
        return found[0] if found else None

    def seq_of(self, message_id: str) -> int:
        self.cursor.execute(STATEMENTS["seq_of"], (message_id,))
        row = self.cursor.fetchone()
        return 0 if row is None else row[0]

    def copies(self, sent_id: str) -> List[Message]:
        return self._rows(STATEMENTS["copies"], (sent_id,))

    def _usage_changed(self, deltas: Mapping[str, List[int]]) -> None:
        changed = sorted(agent for agent, (count, size) in deltas.items() if count or size)
        if changed:
            self.cursor.execute(STATEMENTS["usage_delta"], (
                changed, [deltas[a][0] for a in changed], [deltas[a][1] for a in changed]))

    def usage(self, agent: str) -> Tuple[int, int]:
        self.cursor.execute(STATEMENTS["usage"], (_LOCK_CLASS_RECIPIENT, agent))
        row = self.cursor.fetchone()
        return (0, 0) if row is None or row[0] is None else (row[0], row[1])

    def agent_count(self) -> int:
        self.cursor.execute(STATEMENTS["agent_count"])
        return self.cursor.fetchone()[0]

    def forget(self, cutoff: float) -> List[str]:
        self.cursor.execute(STATEMENTS["forget"], (int(cutoff),))
        gone = sorted(row[0] for row in self.cursor.fetchall())
        if gone:
            self.cursor.execute(STATEMENTS["forget_usage"], (gone,))
            self.notice["forgot"] = 1
        return gone

    def save(self, messages: Sequence[Message], befores: Sequence[Tuple[Any, ...]]) -> None:
        if not messages:
            return
        deltas: Dict[str, List[int]] = {}
        for message, before in zip(messages, befores):
            was, now = before[0] in delivery.PENDING, message.status in delivery.PENDING
            if was != now:
                sign = 1 if now else -1
                entry = deltas.setdefault(message.to, [0, 0])
                entry[0] += sign
                entry[1] += sign * message.stored_bytes()
        self._usage_changed(deltas)
        seqs = [m.seq for m in messages]
        columns: List[List[Any]] = [seqs, [self.versions[s] for s in seqs]]
        states = [m.state() for m in messages]
        columns.extend([state[i] for state in states] for i in range(len(STATE_COLUMNS)))
        self.cursor.execute(_SAVE, columns)
        if self.cursor.rowcount != len(messages):
            raise Conflict()
        for seq in seqs:
            self.versions[seq] += 1

    def claim(self, agent: str, queues: Sequence[str], limit: int, lease_seconds: float,
              now: float, rules: Rules, parent_id: Optional[str] = None) -> List[Message]:
        """Lease up to ``limit`` deliverable messages of ``queues`` to ``agent`` (with
        ``parent_id``: those answering it) in the order of :func:`relay.rules.delivery.rank`,
        in one statement: the state :func:`relay.rules.delivery.lease` gives; notes their
        deadlines."""
        until = delivery.now_ms(now) + int(lease_seconds * 1000)
        lease_ids = [delivery.new_lease_id() for _ in range(limit)]
        params = {"agent": agent, "queues": list(queues), "limit": limit,
                  "lease_ids": lease_ids, "until": until, "now": now, "parent": parent_id}
        sql = STATEMENTS["claim" if parent_id is None else "claim_parent"]
        claimed = sorted(self._rows(sql, params), key=delivery.rank)
        queued = (QUEUED,) + (None,) * (len(STATE_COLUMNS) - 1)
        for message in claimed:
            ops.note(self, queued, message, now, rules)
        return claimed

    def ranked(self, queues: Sequence[str], limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        sql = STATEMENTS["ranked" if parent_id is None else "ranked_parent"]
        params = {"queues": list(queues), "limit": limit, "now": now, "parent": parent_id}
        return self._rows(sql, params)

    def card(self, agent: str) -> Optional[Dict[str, Any]]:
        self.cursor.execute(STATEMENTS["card"], (agent,))
        row = self.cursor.fetchone()
        return None if row is None or row[0] is None else json.loads(row[0])

    def joiners(self, role: str) -> List[str]:
        self.cursor.execute(STATEMENTS["joiners"], (role,))
        return [row[0] for row in self.cursor.fetchall()]

    def queued(self, agent: str, after_seq: int, limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        params = {"agent": agent, "after": after_seq, "limit": limit, "now": now,
                  "parent": parent_id}
        return self._rows(STATEMENTS["queued" if parent_id is None else "queued_parent"],
                          params)

    def recovered(self, agent: str, upto_seq: int, limit: int, now: float) -> List[Message]:
        params = {"agent": agent, "upto": upto_seq, "limit": limit, "now": now}
        return self._rows(STATEMENTS["recovered"], params)

    def lapsed(self, now: float) -> List[Message]:
        return self._rows(STATEMENTS["lapsed"], (delivery.now_ms(now),))

    def held_due(self, now: float, limit: int) -> List[Message]:
        return self._rows(STATEMENTS["held_due"], (now, limit))

    def listing(self, agent: str, box: str, limit: int, filters: Mapping[str, Optional[str]],
                now: float, match: Optional[ops.Match] = None) -> List[Message]:
        params: Dict[str, Any] = {name: filters.get(name) for name, _ in _FILTERS}
        params.update(agent=agent, limit=limit, now=now)
        if match is None:
            return self._rows(_listing_statement(box, filters), params)
        sql = _listing_statement(box, filters, match=True)
        params.update(limit=MATCH_PAGE, before=2**62)
        out: List[Message] = []
        size = 0
        while len(out) < limit and size <= ops.RESPONSE_BUDGET_BYTES:
            page = self._rows(sql, params)
            for message in page:
                if match(message):
                    out.append(message)
                    size += message.size()
                    if len(out) >= limit:
                        break
            if len(page) < MATCH_PAGE:
                break
            params["before"] = page[-1].seq
        return out

    def thread(self, agent: str, root_id: str, after_seq: int, limit: int,
               now: float) -> List[Message]:
        params = {"agent": agent, "root": root_id, "after": after_seq, "limit": limit,
                  "now": now}
        return self._rows(STATEMENTS["thread"], params)

    def expire(self, cutoff: float, now: float, batch: int
               ) -> Tuple[int, int, List[Message], List[Message]]:
        """Remove up to ``batch`` messages stored before ``cutoff`` or past their TTL
        (but return the v2/v3 ones still queued or leased, to be kept)."""
        removed = self._rows(STATEMENTS["expire"], (cutoff, now, batch))
        room = batch - len(removed)
        kept = self._rows(STATEMENTS["expire_kept"], (now, cutoff, room)) if room > 0 else []
        deltas: Dict[str, List[int]] = {}
        for message in removed:
            if message.status in delivery.PENDING:
                entry = deltas.setdefault(message.to, [0, 0])
                entry[0] -= 1
                entry[1] -= message.stored_bytes()
        self._usage_changed(deltas)
        unprocessed = [m for m in removed
                       if m.kind == "request" and m.status in ("queued", "leased")]
        counted = sum(1 for m in removed if m.status != EXPIRED)
        return (len(removed), counted, sorted(unprocessed, key=lambda m: m.seq),
                sorted(kept, key=lambda m: m.seq))

    def depths(self, now: float, settled: Optional[Sequence[str]] = None
               ) -> List[QueueDepth]:
        if settled is None:
            self.cursor.execute(STATEMENTS["depths"], {"now": now})
        else:
            self.cursor.execute(STATEMENTS["depths_settled"], {"now": now,
                                                              "agents": list(settled)})
        found: Dict[str, Dict[str, Any]] = {agent: {"agent": agent} for agent in settled or ()}
        for agent, status, held, count, oldest in self.cursor.fetchall():
            entry = found.setdefault(agent, {"agent": agent})
            if status == "queued" and held:
                entry["delayed"] = count
            else:
                entry[status] = count
                if status == "queued":
                    entry["oldest_queued"] = oldest
        return [QueueDepth(**found[agent]) for agent in sorted(found)]

    def register(self, agent: str, now: float, card: Any = KEEP_CARD) -> None:
        if card is KEEP_CARD:
            self.cursor.execute(STATEMENTS["register"], (agent, int(now)))
        else:
            text = None if card is None else json.dumps(card, separators=(",", ":"))
            self.cursor.execute(STATEMENTS["register_card"], (agent, int(now), text))
        self.registered.add(agent)

    def is_registered(self, agent: str) -> bool:
        """Asks the shared table; an agent found is remembered as registered."""
        self.cursor.execute(STATEMENTS["is_registered"], (agent,))
        if self.cursor.fetchone() is None:
            return False
        self.registered.add(agent)
        return True

    def peers(self) -> List[Tuple[str, int, Optional[Dict[str, Any]]]]:
        self.cursor.execute(STATEMENTS["peers"])
        return [(agent, seen, None if card is None else json.loads(card))
                for agent, seen, card in self.cursor.fetchall()]

    def append_event(self, agent: str, event_type: str, data: str, at: float) -> None:
        self.new_events.append((agent, at, event_type, data))

    def finish(self) -> None:
        """Write the events the operation recorded, each agent's under its lock."""
        if not self.new_events:
            return
        for agent in sorted({e[0] for e in self.new_events}):
            self.cursor.execute(STATEMENTS["event_lock"], (_LOCK_CLASS_EVENTS, agent))
        self.cursor.execute(STATEMENTS["event_insert"],
                            [list(column) for column in zip(*self.new_events)])
        self.new_events = []

    def events_after(self, agent: str, after: int, limit: int) -> List[Event]:
        self.cursor.execute(STATEMENTS["events_after"], (agent, after, limit))
        return [Event(event_id, agent, event_type, data, at)
                for event_id, event_type, data, at in self.cursor.fetchall()]

    def event_marks(self, agent: str = "") -> Tuple[int, int]:
        """The floor, and the newest committed id of ``agent``'s (at least the floor):
        ids other brokers hold uncommitted are not passed over."""
        self.cursor.execute(STATEMENTS["event_marks"], (agent,))
        floor, last = self.cursor.fetchone()
        return floor, max(floor, last)

    def trim_events(self, cutoff: float) -> int:
        self.cursor.execute(STATEMENTS["event_trim"], {"cutoff": cutoff,
                                                       "limit": EVENT_TRIM_BATCH})
        row = self.cursor.fetchone()
        return 0 if row is None else row[0]

    def kept_after(self, agent: str, floor: int) -> int:
        self.cursor.execute(STATEMENTS["event_kept_after"], (agent, floor))
        anchored, anchor = self.cursor.fetchone()
        if anchored is None:
            return floor
        return min(floor, max(anchored, anchor))

    def webhook_states(self) -> Dict[str, str]:
        self.cursor.execute(STATEMENTS["webhooks"])
        return dict(self.cursor.fetchall())

    def webhook_state(self, agent: str) -> Optional[str]:
        """Locked until the operation ends: another broker's change waits for it."""
        self.cursor.execute(STATEMENTS["webhook_lock"], (agent,))
        row = self.cursor.fetchone()
        return None if row is None else row[0]

    def put_webhook(self, agent: str, state: Optional[str]) -> None:
        if state is None:
            self.cursor.execute(STATEMENTS["webhook_drop"], (agent,))
        else:
            self.cursor.execute(STATEMENTS["webhook_put"], (agent, state))

    def notification(self, token: str) -> Optional[str]:
        """The payload that tells other brokers what this transaction changed, or None."""
        if not self.changes and not self.notice:
            return None
        body: Dict[str, Any] = {"b": token}
        if self.changes.ready:
            body["r"] = sorted(self.changes.ready)
        if self.changes.events:
            body["e"] = sorted(self.changes.events)
        if self.changes.hooks:
            body["w"] = sorted(self.changes.hooks)
        due = self.changes.due.union(self.changes.held)  # other brokers' waiters too
        if due:
            body["d"] = sorted([when, agent] for when, agent in due)
        body.update(self.notice)
        payload = json.dumps(body, separators=(",", ":"))
        if len(payload.encode("utf-8")) > NOTIFY_BYTES:
            # Too many agents for one notification: every broker looks for itself.
            slim = {k: v for k, v in body.items() if k not in ("r", "d", "e", "w")}
            payload = json.dumps(dict(slim, all=1), separators=(",", ":"))
        return payload


def heard(payload: str) -> Tuple[Optional[str], Changes, bool, Dict[str, Any]]:
    """``(sender token, changes, look at everything, the rest)`` of a notification."""
    try:
        body = json.loads(payload)
    except ValueError:
        return None, Changes(), False, {}
    if not isinstance(body, dict):
        return None, Changes(), False, {}
    changes = Changes()
    for agent in body.pop("r", ()):
        if isinstance(agent, str):
            changes.ready.add(agent)
    for agent in body.pop("e", ()):
        if isinstance(agent, str):
            changes.events.add(agent)
    for agent in body.pop("w", ()):
        if isinstance(agent, str):
            changes.hooks.add(agent)
    for pair in body.pop("d", ()):
        if (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (int, float))
                and isinstance(pair[1], str)):
            changes.due.add((float(pair[0]), pair[1]))
    return body.pop("b", None), changes, bool(body.pop("all", False)), body


# -- the operations that differ here ----------------------------------------------------


def pull(records: PostgresRecords, agent: str, limit: int, lease_seconds: float, now: float,
         rules: Rules, parent_id: Optional[str] = None,
         role: Optional[str] = None) -> List[Message]:
    """Release lapsed leases (the rules of relay.rules.delivery), then claim from the agent's
    queues (:func:`relay.store.records.queues`) in one statement."""
    ops.release_lapsed(records, now, rules)
    found = ops.queues(records, agent, rules, role)
    return records.claim(agent, found, limit, lease_seconds, now, rules, parent_id)


def is_registered(records: PostgresRecords, agent: str) -> bool:
    return records.is_registered(agent)


def upcoming_deadlines(records: PostgresRecords, now: float) -> Set[Tuple[float, str]]:
    """``(when, agent)`` of each agent's next lease deadline and next delay's end."""
    records.cursor.execute(STATEMENTS["upcoming"], {"now": now, "now_ms": delivery.now_ms(now)})
    return {(float(when), agent) for agent, when in records.cursor.fetchall()}


def every_waiting_agent(records: PostgresRecords, now: float) -> Set[str]:
    """Agents with queued messages or lapsed leases (when notifications may have been lost)."""
    records.cursor.execute(STATEMENTS["queued_agents"])
    agents = {row[0] for row in records.cursor.fetchall()}
    records.cursor.execute(STATEMENTS["lapsed_agents"], (delivery.now_ms(now),))
    agents.update(row[0] for row in records.cursor.fetchall())
    return agents


# -- connections ------------------------------------------------------------------------


def conninfo_with_defaults(dsn: str) -> str:
    """``dsn`` with :data:`CONNECTION_DEFAULTS` for what it does not set."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    given = conninfo_to_dict(dsn)
    merged = dict(CONNECTION_DEFAULTS)
    merged.update({k: str(v) for k, v in given.items()})
    return make_conninfo("", **merged)


def connect(conninfo: str, autocommit: bool = False):
    """A new connection with the broker's session settings."""
    import psycopg

    conn = psycopg.connect(conninfo, autocommit=autocommit)
    try:
        conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        conn.execute("SET idle_in_transaction_session_timeout = 60000")
        if not autocommit:
            conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


class _Outcome:
    __slots__ = ("result", "error", "changes", "registered", "commit_seconds")

    def __init__(self, result: Any, error: Optional[BaseException], records: PostgresRecords,
                 commit_seconds: float) -> None:
        self.result = result
        self.error = error
        self.changes = records.changes
        self.registered = records.registered
        self.commit_seconds = commit_seconds


class _Job:
    __slots__ = ("deferred", "abandoned", "timeout")

    def __init__(self) -> None:
        self.deferred = Deferred()
        self.abandoned = False
        self.timeout = None


class Connections:
    """Worker threads, each with its own connection, (re)opened when needed."""

    def __init__(self, conninfo: str, size: int, token: str) -> None:
        import psycopg

        self.psycopg = psycopg
        self.conninfo = conninfo
        self.token = token
        self.threads = ThreadPool(minthreads=0, maxthreads=size, name="relay-postgres")
        self.local = threading.local()
        self.lock = threading.Lock()
        self.open: Set[Any] = set()

    def _connection(self) -> Tuple[Any, bool]:
        conn = getattr(self.local, "conn", None)
        if conn is not None and not conn.closed:
            return conn, False
        try:
            conn = connect(self.conninfo)
        except self.psycopg.Error as e:
            raise Unavailable(_reason(e)) from None
        self.local.conn = conn
        with self.lock:
            self.open.add(conn)
        return conn, True

    def _drop(self, conn: Any) -> None:
        self.local.conn = None
        with self.lock:
            self.open.discard(conn)
        with contextlib.suppress(self.psycopg.Error):
            conn.close()

    def interact(self, job: Optional[_Job], operation: Callable[..., Any],
                 args: Sequence[Any]) -> Optional[_Outcome]:
        """Run ``operation(records, *args)`` in one transaction (in a worker thread)."""
        psycopg = self.psycopg
        fresh_retry = True
        for attempt in range(MAX_TRIES):
            if job is not None and job.abandoned:
                return None
            conn, fresh = self._connection()
            committing = False
            try:
                with conn.cursor() as cursor:
                    records = PostgresRecords(cursor)
                    try:
                        result, error = operation(records, *args), None
                    except RelayError as e:
                        # What the operation changed before refusing stays (a lapsed
                        # lease found by a refused ack is released).
                        result, error = None, e
                    records.finish()
                    payload = records.notification(self.token)
                    if payload is not None:
                        cursor.execute(STATEMENTS["notify"], (CHANNEL, payload))
                    committing = True
                    started = time.monotonic()
                    conn.commit()
                return _Outcome(result, error, records, time.monotonic() - started)
            except (Conflict, ops.Raced, psycopg.errors.TransactionRollback):
                # another broker won a race, or PostgreSQL broke a deadlock: run it again
                self._rollback(conn)
                if attempt + 1 < MAX_TRIES:
                    _pause(attempt)
            except psycopg.OperationalError as e:
                if conn.broken or conn.closed:
                    self._drop(conn)
                    # Nothing was committed unless the COMMIT was sent: run it again
                    # once on a new connection (the old one may have been cut while idle).
                    if not committing and not fresh and fresh_retry:
                        fresh_retry = False
                        continue
                else:
                    self._rollback(conn)
                raise Unavailable(_reason(e)) from None
            except psycopg.DataError:
                self._rollback(conn)
                raise errors.bad_request(
                    "a field holds a value this store cannot keep (such as U+0000 in text)"
                ) from None
            except BaseException:
                self._rollback(conn)
                raise
        raise Unavailable("too many conflicting writes")

    def _rollback(self, conn: Any) -> None:
        try:
            conn.rollback()
        except self.psycopg.Error:
            self._drop(conn)

    def close(self) -> None:
        """Stop the threads (after their current work) and close every connection."""
        self.threads.stop()
        with self.lock:
            conns, self.open = list(self.open), set()
        for conn in conns:
            with contextlib.suppress(self.psycopg.Error):
                conn.close()


def _pause(attempt: int) -> None:
    """A short random pause between retries of a conflicting write."""
    threading.Event().wait(random.uniform(0, 0.002 * (attempt + 1)))


def _reason(error: BaseException) -> str:
    """The first line of a driver error (never a query or its parameters)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# -- LISTEN -----------------------------------------------------------------------------


class Listener:
    """One autocommit connection that listens on :data:`CHANNEL`, in its own thread.

    Calls ``heard(payload)`` and, after each (re)connect, ``connected(first)`` on
    the reactor thread. Reconnects by itself; a probe every ``LISTEN_PROBE_SECONDS``
    finds a connection that died silently.
    """

    def __init__(self, conninfo: str, reactor: Any, heard: Callable[[str], None],
                 connected: Callable[[bool], None]) -> None:
        self.conninfo = conninfo
        self.reactor = reactor
        self.heard = heard
        self.connected = connected
        self.stopping = threading.Event()
        self.up = threading.Event()
        self.thread = threading.Thread(target=self._run, name="relay-postgres-listen",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        import psycopg

        failures, first = 0, True
        while not self.stopping.is_set():
            conn = None
            try:
                conn = connect(self.conninfo, autocommit=True)
                conn.execute(f"LISTEN {CHANNEL}")
                failures = 0
                self.up.set()
                self.reactor.callFromThread(self.connected, first)
                first = False
                probed = time.monotonic()
                while not self.stopping.is_set():
                    for notify in conn.notifies(timeout=LISTEN_WAIT_SECONDS):
                        self.reactor.callFromThread(self.heard, notify.payload)
                    if time.monotonic() - probed >= LISTEN_PROBE_SECONDS:
                        conn.execute("SELECT 1")
                        probed = time.monotonic()
            except psycopg.Error as e:
                if not self.stopping.is_set():
                    log.warn("postgres LISTEN connection lost ({reason}); reconnecting",
                             reason=_reason(e))
            finally:
                self.up.clear()
                if conn is not None:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
            self.stopping.wait(RECONNECT_SECONDS[min(failures, len(RECONNECT_SECONDS) - 1)])
            failures += 1

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(LISTEN_WAIT_SECONDS + 5)


# -- migrations -------------------------------------------------------------------------


def migration_script(version: int) -> str:
    """The SQL that brings the schema from ``version - 1`` to ``version``."""
    name = f"migration-{version}.sql"
    return resources.files("relay.store.postgres").joinpath(name).read_text("utf-8")


def migrate(conn: Any, target: int = SCHEMA_VERSION,
            script: Callable[[int], str] = migration_script) -> int:
    """Bring the schema to ``target`` under the migration lock; returns the version found.

    Each migration runs in its own transaction with the row that records it.
    Refuses a database migrated by a newer broker.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (_LOCK_CLASS_MIGRATION,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS relay_schema (version integer PRIMARY KEY, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        found = conn.execute("SELECT coalesce(max(version), 0) FROM relay_schema").fetchone()[0]
    if found > target:
        raise ConfigError(
            "broker.postgres.dsn",
            f"the database has relay schema version {found}, newer than this broker's "
            f"{target}: it was migrated by a newer relay; run that version",
        )
    for version in range(found + 1, target + 1):
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (_LOCK_CLASS_MIGRATION,))
            done = conn.execute("SELECT 1 FROM relay_schema WHERE version = %s",
                                (version,)).fetchone()
            if done is None:  # another broker may have migrated meanwhile
                conn.execute(script(version))
                conn.execute("INSERT INTO relay_schema (version) VALUES (%s)", (version,))
                log.info("postgres schema migrated to version {version}", version=version)
    return found


# -- the store --------------------------------------------------------------------------


@implementer(IMessageStore, ISharedLockouts, ISharedNonces)
class PostgresStore:
    """Messages, peers, lockout counters and seen nonces in one PostgreSQL database,
    shared by every broker that opens it."""

    name = "postgres"

    def __init__(self, conninfo: str, listen_conninfo: str, pool_size: int,
                 reactor: Any) -> None:
        self.clock = reactor
        self.reactor = reactor
        self.token = os.urandom(8).hex()
        self.connections = Connections(conninfo, pool_size, self.token)
        self.connections.threads.start()
        self._listeners: List[Callable[[Changes], None]] = []
        self._commit_observers: List[Callable[[float], None]] = []
        self.failure: Optional[str] = None  # why the last operation found no database
        self._registered: Set[str] = set()
        self.lockouts: Optional[PostgresLockouts] = None
        self.closed = False
        self._looking = False
        self.listener = Listener(listen_conninfo, reactor, self._heard, self._listening)
        self.listener.start()
        # Nobody waits before the broker serves; from the first LISTEN on, nothing is missed.
        self.listener.up.wait(LISTEN_START_SECONDS)
        self.fallback = LoopingCall(self._look)
        self.fallback.clock = reactor
        self.fallback.start(FALLBACK_SECONDS, now=False)

    # -- running operations -------------------------------------------------------------

    def _run(self, operation: Callable[..., Any], *args: Any) -> Deferred:
        if self.closed:
            return _failed(errors.busy("the broker is stopping"))
        job = _Job()
        job.timeout = self.clock.callLater(OPERATION_SECONDS, self._timed_out, job)

        def landed(ok: bool, outcome: Any) -> None:
            self.reactor.callFromThread(self._landed, job, ok, outcome)

        self.connections.threads.callInThreadWithCallback(
            landed, self.connections.interact, job, operation, args)
        return job.deferred

    def _timed_out(self, job: _Job) -> None:
        job.abandoned = True
        job.timeout = None
        log.warn("postgres: an operation took over {seconds} s; answered busy",
                 seconds=OPERATION_SECONDS)
        job.deferred.errback(errors.busy("the database did not answer in time"))

    def _landed(self, job: _Job, ok: bool, outcome: Any) -> None:
        if job.timeout is not None and job.timeout.active():
            job.timeout.cancel()
        if ok and isinstance(outcome, _Outcome):
            self.failure = None
            self._registered |= outcome.registered
            for observer in self._commit_observers:
                observer(outcome.commit_seconds)
            if outcome.changes:
                self._report(outcome.changes)
        elif not ok and isinstance(outcome.value, Unavailable):
            self.failure = f"the database is unavailable: {outcome.value}"
        if job.abandoned:
            return
        job.abandoned = True
        if not ok:
            error = outcome.value
            if isinstance(error, Unavailable):
                log.warn("postgres unavailable: {reason}", reason=str(error))
                error = errors.busy("the database is unavailable; try again")
            job.deferred.errback(error)
        elif outcome.error is not None:
            job.deferred.errback(outcome.error)
        else:
            job.deferred.callback(outcome.result)

    def _report(self, changes: Changes) -> None:
        for listener in self._listeners:
            listener(changes)

    # -- notifications ------------------------------------------------------------------

    def _heard(self, payload: str) -> None:
        token, changes, everything, rest = heard(payload)
        if token == self.token or self.closed:
            return
        if everything:
            self._wake_everyone()
        if changes:
            self._report(changes)
        if rest.pop("forgot", None):
            self._registered.clear()  # another broker forgot agents: ask the table again
        if rest and self.lockouts is not None:
            self.lockouts.heard(rest)

    def _listening(self, first: bool) -> None:
        """The LISTEN connection is up; after a reconnect, notifications may have been
        missed while it was down: the agents with work now, and the deadlines other
        brokers set meanwhile (without them, a waiter here would sleep through a
        lease running out or a delay ending until its own time is up)."""
        if not first and not self.closed:
            self._wake_everyone()
            d = self._run(upcoming_deadlines, self.clock.seconds())
            d.addCallbacks(self._due, _ignore_unavailable)

    def _due(self, deadlines: Iterable[Tuple[float, str]]) -> None:
        changes = Changes()
        changes.due.update(deadlines)
        if changes:
            self._report(changes)

    def _look(self) -> None:
        """The fallback (every FALLBACK_SECONDS): while the LISTEN connection is down,
        no notification arrives, so look for every agent with something to take."""
        if not self.listener.up.is_set() and not self._looking and not self.closed:
            self._looking = True
            self._wake_everyone().addBoth(self._looked)

    def _looked(self, _: Any) -> None:
        self._looking = False

    def _wake_everyone(self) -> Deferred:
        d = self._run(every_waiting_agent, self.clock.seconds())
        d.addCallbacks(self._ready, _ignore_unavailable)
        return d

    def _ready(self, agents: Iterable[str]) -> None:
        changes = Changes()
        changes.ready.update(agents)
        changes.events.add(ALL_AGENTS)  # events may have been missed too: streams look
        changes.hooks.add(ALL_AGENTS)  # and webhook settings: read again
        if changes:
            self._report(changes)

    # -- IMessageStore ------------------------------------------------------------------

    def subscribe(self, listener: Callable[[Changes], None]) -> None:
        self._listeners.append(listener)

    def add(self, message: Message, rules: Rules,
            registered_recipient: bool = False) -> Deferred:
        """A recipient this broker knows registered is not looked up again."""
        if registered_recipient and message.to in self._registered:
            registered_recipient = False
        return self._run(ops.add, message, rules, registered_recipient)

    def add_group(self, copies: Sequence[Message], sender: str, sent_id: str,
                  rules: Rules) -> Deferred:
        return self._run(ops.add_group, copies, sender, sent_id, rules)

    def find(self, message_id: str, now: float, expired: bool = False) -> Deferred:
        return self._run(ops.find, message_id, now, expired)

    def poll(self, agent: str, since_id: Optional[str], limit: int, now: float,
             rules: Rules) -> Deferred:
        return self._run(ops.poll, agent, since_id, limit, now, rules)

    def pull(self, agent: str, limit: int, lease_seconds: float, now: float, rules: Rules,
             parent_id: Optional[str] = None, role: Optional[str] = None) -> Deferred:
        return self._run(pull, agent, limit, lease_seconds, now, rules, parent_id, role)

    def settle(self, message_id: str, transition: Union[Transition, WithStored], now: float,
               rules: Rules) -> Deferred:
        return self._run(ops.settle, message_id, transition, now, rules)

    def status(self, message_ids: Sequence[str], agent: str, now: float,
               rules: Rules) -> Deferred:
        return self._run(ops.status, message_ids, agent, now, rules)

    def recent(self, agent: str, limit: int, now: float, rules: Rules) -> Deferred:
        return self._run(ops.recent, agent, limit, now, rules)

    def query(self, agent: str, limit: int, filters: Mapping[str, Optional[str]], now: float,
              rules: Rules, match: Optional[ops.Match] = None) -> Deferred:
        return self._run(ops.query, agent, limit, filters, now, rules, match)

    def thread(self, agent: str, root_id: str, since_id: Optional[str], limit: int,
               now: float, rules: Rules) -> Deferred:
        return self._run(ops.thread, agent, root_id, since_id, limit, now, rules)

    def register(self, agent: str, now: float, card: Any = KEEP_CARD,
                 max_agents: int = 0) -> Deferred:
        return self._run(ops.register, agent, now, card, max_agents)

    def forget_peers(self, cutoff: float) -> Deferred:
        d = self._run(ops.forget, cutoff)

        def forgotten(gone: List[str]) -> List[str]:
            self._registered.difference_update(gone)
            return gone

        d.addCallback(forgotten)
        return d

    def space_left(self) -> Optional[int]:
        """None: the database's disk is the database server's to watch."""
        return None

    def is_registered(self, agent: str) -> Deferred:
        """Fires at once with True for an agent known to have registered (until some
        broker forgets agents); otherwise after asking the shared table."""
        if agent in self._registered:
            return succeed(True)
        return self._run(is_registered, agent)

    def peers(self) -> Deferred:
        return self._run(ops.peers)

    def sweep_leases(self, now: float, rules: Rules) -> Deferred:
        return self._run(ops.release_lapsed, now, rules)

    @inlineCallbacks
    def sweep_expired(self, cutoff: float, now: float, rules: Rules):
        """Removes in batches of EXPIRE_BATCH, one transaction each (with the failure
        notices of the requests it removed unprocessed); then forgets the seen
        nonces whose window is over."""
        total = 0
        while True:
            touched, counted = yield self._run(ops.expire, cutoff, now, rules, EXPIRE_BATCH)
            total += counted
            if touched < EXPIRE_BATCH:
                break
        yield self._run(nonce_forget, int(now))
        return total

    def events(self, agent: str, position: Optional[int], limit: int) -> Deferred:
        return self._run(ops.read_events, agent, position, limit)

    def trim_events(self, cutoff: float) -> Deferred:
        return self._run(ops.trim_events, cutoff)

    def release_due(self, now: float, rules: Optional[Rules] = None) -> Deferred:
        return self._run(ops.release_due, now, rules)

    def webhook_states(self) -> Deferred:
        return self._run(ops.webhook_states)

    def put_webhook(self, agent: str, state: Optional[str]) -> Deferred:
        return self._run(ops.put_webhook, agent, state)

    def merge_webhook(self, agent: str, fields: Mapping[str, Any],
                      defaults: Optional[Mapping[str, Any]] = None,
                      announce: bool = True) -> Deferred:
        return self._run(ops.merge_webhook, agent, fields, defaults, announce)

    def lead_webhooks(self, owner: str, now: float, hold: float) -> Deferred:
        return self._run(ops.lead_webhooks, owner, now, hold)

    def queue_depths(self, now: float, settled: Optional[Sequence[str]] = None) -> Deferred:
        return self._run(ops.depths, now, settled)

    def health(self) -> Deferred:
        """None while operations reach the database; the reason once one did not
        (until one does again)."""
        return succeed(self.failure)

    def observe_commits(self, listener: Callable[[float], None]) -> None:
        self._commit_observers.append(listener)

    def close(self) -> Deferred:
        """Stop the fallback look, the listener and the workers; close the connections."""
        if self.closed:
            return succeed(None)
        self.closed = True
        if self.fallback.running:
            self.fallback.stop()
        if self.lockouts is not None:
            self.lockouts.stop()

        def shut() -> None:
            self.listener.stop()
            self.connections.close()

        return deferToThreadPool(self.reactor, self.reactor.getThreadPool(), shut)

    # -- ISharedLockouts ------------------------------------------------------------------

    def share_lockouts(self, lockout: Any) -> PostgresLockouts:
        self.lockouts = PostgresLockouts(self, lockout)
        self.lockouts.start()
        return self.lockouts

    # -- ISharedNonces --------------------------------------------------------------------

    def claim_nonce(self, agent: str, nonce: str, timestamp: int,
                    address: Optional[str] = None) -> Deferred:
        """True when no broker on this database used ``nonce`` of ``agent`` within the
        skew window, False when one did; 503 ``busy`` when the database cannot tell.
        With ``address`` and shared lockouts, a lock of the agent in force for that
        address (set by any broker) is applied to this broker's lockout first."""
        expires, now = timestamp + MAX_CLOCK_SKEW_SECONDS, int(self.clock.seconds())
        lockouts = self.lockouts
        if address is None or lockouts is None:
            return self._run(nonce_claim, agent, nonce, expires, now)

        def claimed(outcome: Tuple[bool, Optional[str], Optional[float]]) -> bool:
            first, scope, until = outcome
            if scope is not None and until is not None:
                lockouts.lockout.lock(agent, until, scope)
            return first

        d = self._run(nonce_claim_locked, agent, nonce, expires, now, address)
        return d.addCallback(claimed)


def _failed(error: BaseException) -> Deferred:
    d = Deferred()
    d.errback(error)
    return d


def _ignore_unavailable(failure) -> None:
    failure.trap(RelayError)


# -- shared lockouts --------------------------------------------------------------------


def lockout_failed(records: PostgresRecords, agent: str, address: str, now: float, after: int,
                   seconds: float) -> Optional[Tuple[str, float]]:
    """Count a failure of ``agent`` from ``address`` for every broker, by the rules of
    :class:`relay.rules.auth.Lockout`; the lock it caused (its address, or ``*`` for the
    agent's own, and its end), or None."""
    cursor = records.cursor
    cursor.execute(STATEMENTS["lockout_spread"],
                   {"agent": agent, "now": now, "period": now - seconds})
    count, started = cursor.fetchone()
    cursor.execute(STATEMENTS["lockout_failed"], {"agent": agent, "address": address, "now": now})
    (failures,) = cursor.fetchone()
    cursor.execute(STATEMENTS["lockout_addresses"], (agent, started))
    (addresses,) = cursor.fetchone()
    if count >= after and addresses >= AGENT_LOCK_ADDRESSES:
        address = EVERY_ADDRESS
    elif failures < after:
        records.notice["fail"] = [agent, address]
        return None
    until = now + seconds
    cursor.execute(STATEMENTS["lockout_lock"], (until, now, agent, address))
    records.notice["lock"] = [agent, until, address]
    return address, until


def lockout_impose(records: PostgresRecords, agent: str, address: str, until: float,
                   now: float) -> None:
    """Lock ``agent`` from ``address`` (``*``: every address) until ``until`` on every
    broker."""
    records.cursor.execute(STATEMENTS["lockout_impose"], (agent, address, until, now))
    records.notice["lock"] = [agent, until, address]


def lockout_succeeded(records: PostgresRecords, agent: str, address: str, now: float) -> None:
    records.cursor.execute(STATEMENTS["lockout_reset"], (now, agent, address))
    records.notice["reset"] = [agent, address]


def lockout_unlock(records: PostgresRecords, agent: str) -> None:
    """An operator cleared ``agent``'s locks and counts, for every broker."""
    records.cursor.execute(STATEMENTS["lockout_unlock"], (agent,))
    records.notice["unlock"] = agent


def lockout_load(records: PostgresRecords) -> List[Tuple[str, str, int, Optional[float]]]:
    records.cursor.execute(STATEMENTS["lockout_load"])
    return [tuple(row) for row in records.cursor.fetchall()]


def lockout_forget(records: PostgresRecords, now: float) -> int:
    records.cursor.execute(STATEMENTS["lockout_forget"], (now - LOCKOUT_FORGET_SECONDS, now))
    return records.cursor.rowcount


# -- shared nonces -----------------------------------------------------------------------


def nonce_claim(records: PostgresRecords, agent: str, nonce: str, expires: int,
                now: int) -> bool:
    """Claim ``nonce`` of ``agent`` until ``expires``; True when it was not in use at
    ``now`` (epoch seconds)."""
    records.cursor.execute(STATEMENTS["nonce_claim"], (agent, nonce, expires, now))
    return records.cursor.fetchone() is not None


def nonce_claim_locked(records: PostgresRecords, agent: str, nonce: str, expires: int,
                       now: int, address: str) -> Tuple[bool, Optional[str], Optional[float]]:
    """:func:`nonce_claim`, and the lock of ``agent`` in force at ``now`` for
    ``address`` or every address: ``(first, its address or "*", its end)``, Nones
    for no lock."""
    records.cursor.execute(STATEMENTS["nonce_claim_locked"], {
        "agent": agent, "nonce": nonce, "expires": expires, "now": now, "address": address})
    count, scope, until = records.cursor.fetchone()
    return count > 0, scope, until


def nonce_forget(records: PostgresRecords, now: int) -> int:
    """Delete the nonces whose window ended before ``now``; returns how many."""
    records.cursor.execute(STATEMENTS["nonce_forget"], (now,))
    return records.cursor.rowcount


class PostgresLockouts:
    """Lockout counters shared by every broker on the database.

    The authentication path reads the broker's own :class:`relay.rules.auth.Lockout`,
    at once. Each failure is also counted in ``relay_lockouts`` (one transaction,
    by the same rules), and the refusal is answered only once that is done
    (:attr:`relay.wire.errors.RelayError.pending`): the broker whose count reaches a
    lock sets it there, applies it to its own ``Lockout`` before answering, and
    notifies the others, which apply it to theirs when PostgreSQL delivers the
    notification (sent at the commit, before the refusal is answered). N brokers
    give an attacker the attempts of one. A success resets the shared count of
    its address when some broker counted failures there; a broker whose own
    count locks an agent (the shared one was reset meanwhile) sets that lock for
    every broker too. An operator's unlock clears the agent everywhere.
    """

    def __init__(self, store: PostgresStore, lockout: Any) -> None:
        self.store = store
        self.lockout = lockout
        # (agent, address) with failures counted on some broker
        self.failing: Dict[Tuple[str, str], None] = {}
        self.sweep = LoopingCall(self._forget)
        self.sweep.clock = store.clock

    def start(self) -> None:
        d = self.store._run(lockout_load)
        d.addCallbacks(self._loaded, self._warn)
        self.sweep.start(LOCKOUT_SWEEP_SECONDS, now=False)

    def stop(self) -> None:
        if self.sweep.running:
            self.sweep.stop()

    def _loaded(self, rows: List[Tuple[str, str, int, Optional[float]]]) -> None:
        now = self.store.clock.seconds()
        for agent, address, failures, until in rows:
            if until is not None and until > now:
                self.lockout.lock(agent, until, address)
            if failures and address != EVERY_ADDRESS:
                self._note(agent, address)

    def _note(self, agent: str, address: str) -> None:
        self.failing[(agent, address)] = None
        if len(self.failing) > self.lockout.max_tracked:
            del self.failing[next(iter(self.failing))]

    def _warn(self, failure) -> None:
        log.warn("postgres: shared lockout counters not updated ({kind})",
                 kind=failure.type.__name__)

    # -- what relay.rules.auth.Lockout reports ---------------------------------------------------

    def failed(self, agent: str, address: str) -> Deferred:
        self._note(agent, address)
        now = self.store.clock.seconds()
        d = self.store._run(lockout_failed, agent, address, now, self.lockout.after,
                            self.lockout.seconds)

        def counted(locked: Optional[Tuple[str, float]]) -> Optional[Deferred]:
            if locked is not None:
                scope, until = locked
                self.failing.pop((agent, address), None)
                if self.lockout.lock(agent, until, scope) is not None:
                    log.warn("agent {agent} is locked {scope} after repeated authentication "
                             "failures (counted on every broker)", agent=agent,
                             scope="from every address" if scope == EVERY_ADDRESS
                             else f"for address {scope}")
                return None
            # Locked here on this broker's own count while the shared one was reset
            # meanwhile (a success on another broker between the failures): the
            # lock holds on every broker all the same.
            left, scope = self.lockout.seconds_left(agent, address)
            if left > 0:
                self.failing.pop((agent, address), None)
                ends = self.store.clock.seconds() + left
                return self.store._run(lockout_impose, agent, scope, ends, now)
            return None

        d.addCallback(counted)
        d.addErrback(self._warn)
        return d

    def succeeded(self, agent: str, address: str) -> None:
        if (agent, address) not in self.failing:
            return
        del self.failing[(agent, address)]
        d = self.store._run(lockout_succeeded, agent, address, self.store.clock.seconds())
        d.addErrback(self._warn)

    def unlocked(self, agent: str) -> Deferred:
        for key in [key for key in self.failing if key[0] == agent]:
            del self.failing[key]
        return self.store._run(lockout_unlock, agent)

    # -- what other brokers report ---------------------------------------------------------

    def heard(self, notice: Mapping[str, Any]) -> None:
        lock = notice.get("lock")
        if (isinstance(lock, list) and len(lock) == 3 and isinstance(lock[0], str)
                and isinstance(lock[1], (int, float)) and isinstance(lock[2], str)):
            self.failing.pop((lock[0], lock[2]), None)
            self.lockout.lock(lock[0], float(lock[1]), lock[2])
        failed = _pair(notice.get("fail"))
        if failed is not None:
            self._note(*failed)
        reset = _pair(notice.get("reset"))
        if reset is not None:
            self.failing.pop(reset, None)
            self.lockout.clear(*reset)
        unlocked = notice.get("unlock")
        if isinstance(unlocked, str):
            for key in [key for key in self.failing if key[0] == unlocked]:
                del self.failing[key]
            self.lockout.forget(unlocked)

    def _forget(self) -> Deferred:
        d = self.store._run(lockout_forget, self.store.clock.seconds())
        d.addErrback(self._warn)
        return d


def _pair(value: Any) -> Optional[Tuple[str, str]]:
    """``(agent, address)`` of a notification, or None for anything else."""
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], str)):
        return value[0], value[1]
    return None


# -- configuration and opening -----------------------------------------------------------


# The keys of ``broker.postgres`` (see relay.rules.config.Setting); the section is read at start.
SETTINGS = (
    Setting("broker.postgres", "dsn", "dsn", "text", None,
            shown="— (required with `storage: postgres`)", restart=True),
    Setting("broker.postgres", "poolSize", "pool_size", "int", DEFAULT_POOL_SIZE, 1, 200,
            restart=True),
    Setting("broker.postgres", "listenDsn", "listen_dsn", "text", None, shown="`dsn`",
            restart=True),
)


@dataclass(frozen=True)
class PostgresOptions:
    """``broker.postgres``: ``dsn`` (libpq), ``poolSize``, ``listenDsn`` (``dsn`` when None)."""

    dsn: str
    pool_size: int
    listen_dsn: Optional[str]


def parse_options(section: Mapping[str, Any], config: Config) -> PostgresOptions:
    """Validate ``broker.postgres`` (the IStoreFactory entry point); needs no driver."""
    prefix = "broker.postgres"
    check_keys(section, prefix, table_keys(SETTINGS), frozenset())
    values = read_settings(SETTINGS, section)
    if values["dsn"] is None:
        if config.storage_backend == "postgres":
            raise ConfigError(f"{prefix}.dsn", "is required with broker.storage: postgres "
                              "(a libpq connection string, e.g. postgresql://relay@db/relay)")
        values["dsn"] = ""
    return PostgresOptions(**values)


def _driver() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError(
            "broker.storage",
            f"postgres needs the psycopg driver, which is not installed: {INSTALL_HINT}",
        ) from None
    return psycopg


def standby_refusal(conn: Any, key: str) -> Optional[ConfigError]:
    """The start's refusal when ``conn`` reached a hot standby, which can take no
    writes (None when it reached a primary)."""
    if not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
        return None
    return ConfigError(key, f"{conn.info.host}:{conn.info.port} is a read-only standby: "
                       f"point {key} at the primary, or list every host with "
                       "target_session_attrs=read-write")


def _standby_behind(conninfo: str, key: str) -> Optional[ConfigError]:
    """When a connection that asks for a writable server failed: the refusal of a
    standby, if what the connection string names is one."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    given = conninfo_to_dict(conninfo)
    if given.get("target_session_attrs") in (None, "any"):
        return None
    try:
        conn = connect(make_conninfo(conninfo, target_session_attrs="any"), autocommit=True)
    except psycopg.Error:
        return None
    try:
        return standby_refusal(conn, key)
    finally:
        conn.close()


def _check_writable(conninfo: str, key: str) -> None:
    """Refuse the start when ``conninfo`` leads to a standby (the listener's own DSN)."""
    import psycopg

    try:
        conn = connect(conninfo, autocommit=True)
    except psycopg.Error as e:
        raise _standby_behind(conninfo, key) or ConfigError(
            key, f"cannot connect: {_reason(e)}") from None
    try:
        refusal = standby_refusal(conn, key)
    finally:
        conn.close()
    if refusal is not None:
        raise refusal


def open_store(config: Config, options: PostgresOptions, reactor: Any) -> PostgresStore:
    """Connect, migrate the schema, start the workers and the listener (the
    IStoreFactory entry point); ConfigError with the reason when impossible.

    ``reactor`` provides ``IReactorTime`` and ``IReactorThreads``: the operations
    run in the store's own worker threads and land on the reactor thread through
    ``callFromThread``; TypeError when it does not.
    """
    if not (IReactorTime.providedBy(reactor) and IReactorThreads.providedBy(reactor)):
        raise TypeError("the postgres store needs a reactor providing IReactorTime and "
                        "IReactorThreads")
    psycopg = _driver()
    try:
        conninfo = conninfo_with_defaults(options.dsn)
        listen_conninfo = conninfo_with_defaults(options.listen_dsn or options.dsn)
    except psycopg.Error as e:
        raise ConfigError("broker.postgres.dsn", f"is not a valid connection string: "
                          f"{_reason(e)}") from None
    try:
        conn = connect(conninfo, autocommit=True)
    except psycopg.Error as e:
        raise _standby_behind(conninfo, "broker.postgres.dsn") or ConfigError(
            "broker.postgres.dsn", f"cannot connect: {_reason(e)}") from None
    except TypeError as e:  # psycopg's ctypes binding of libpq on PyPy 7.3.11
        raise ConfigError(
            "broker.storage",
            f"postgres: the psycopg driver cannot run on this interpreter ({e}); "
            "run this broker on CPython",
        ) from None
    try:
        refusal = standby_refusal(conn, "broker.postgres.dsn")
        if refusal is not None:
            raise refusal
        migrate(conn)
    except psycopg.Error as e:
        raise ConfigError("broker.postgres.dsn", f"cannot migrate the schema: {_reason(e)}"
                          ) from None
    finally:
        conn.close()
    if options.listen_dsn:
        # LISTEN is refused on a standby: the broker would never hear another one
        _check_writable(listen_conninfo, "broker.postgres.listenDsn")
    return PostgresStore(conninfo, listen_conninfo, options.pool_size, reactor)


__all__ = ["PostgresStore", "PostgresRecords", "PostgresOptions", "open_store", "parse_options",
           "migrate", "SCHEMA_VERSION"]

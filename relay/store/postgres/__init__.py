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

The package, one module per job: ``statements`` (the columns and the SQL),
``records`` (the primitives of one transaction and its notification),
``connections`` (worker threads and their connections), ``listener`` (LISTEN),
``migrations`` (the schema and its scripts), ``shared`` (lockouts and nonces
across brokers), ``store`` (:class:`PostgresStore`) and ``options``
(``broker.postgres`` and the opening of the store).
"""
from relay.store.postgres.connections import Connections, conninfo_with_defaults
from relay.store.postgres.migrations import SCHEMA_VERSION, migrate, migration_script
from relay.store.postgres.options import SETTINGS, PostgresOptions, open_store, parse_options
from relay.store.postgres.records import NOTIFY_BYTES, Conflict, PostgresRecords, heard
from relay.store.postgres.shared import PostgresLockouts, nonce_claim, nonce_forget
from relay.store.postgres.statements import FILTERS, listing_statement
from relay.store.postgres.store import PostgresStore

__all__ = ["PostgresStore", "PostgresRecords", "PostgresOptions", "PostgresLockouts",
           "open_store", "parse_options", "migrate", "migration_script", "SCHEMA_VERSION",
           "SETTINGS", "heard", "Conflict", "Connections", "conninfo_with_defaults",
           "nonce_claim", "nonce_forget", "NOTIFY_BYTES", "FILTERS", "listing_statement"]

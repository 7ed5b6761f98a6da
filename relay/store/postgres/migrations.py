"""The schema of the postgres store, created and migrated at start by the numbered
scripts ``migration-N.sql`` (this package's data), one transaction each, under an
advisory lock."""

from __future__ import annotations

from importlib import resources
from typing import Any, Callable

from twisted.logger import Logger

from relay.store.postgres.statements import LOCK_CLASS_MIGRATION
from relay.wire.errors import ConfigError

log = Logger(namespace="relay.store.postgres")

SCHEMA_VERSION = 13


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
        conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (LOCK_CLASS_MIGRATION,))
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
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (LOCK_CLASS_MIGRATION,))
            done = conn.execute("SELECT 1 FROM relay_schema WHERE version = %s",
                                (version,)).fetchone()
            if done is None:  # another broker may have migrated meanwhile
                conn.execute(script(version))
                conn.execute("INSERT INTO relay_schema (version) VALUES (%s)", (version,))
                log.info("postgres schema migrated to version {version}", version=version)
    return found

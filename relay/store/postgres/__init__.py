"""The PostgreSQL backend (``broker.storage: postgres``): one database, several brokers."""

from relay.store.postgres.store import (
    _FILTERS,
    NOTIFY_BYTES,
    SCHEMA_VERSION,
    SETTINGS,
    Conflict,
    Connections,
    PostgresOptions,
    PostgresRecords,
    PostgresStore,
    _listing_statement,
    conninfo_with_defaults,
    heard,
    migrate,
    migration_script,
    nonce_claim,
    nonce_forget,
    open_store,
    parse_options,
)

__all__ = ["PostgresStore", "PostgresRecords", "PostgresOptions", "open_store", "parse_options",
           "migrate", "migration_script", "SCHEMA_VERSION", "SETTINGS", "heard", "Conflict",
           "Connections", "conninfo_with_defaults", "nonce_claim", "nonce_forget",
           "NOTIFY_BYTES", "_FILTERS", "_listing_statement"]

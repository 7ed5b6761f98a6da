"""``broker.postgres``: its keys and their validation, and the opening of the store
(the IStoreFactory entry points)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from twisted.internet.interfaces import IReactorThreads, IReactorTime

from relay.rules.config import Config, Setting, check_keys, read_settings, table_keys
from relay.store.postgres.connections import connect, conninfo_with_defaults, failure_reason
from relay.store.postgres.migrations import migrate
from relay.store.postgres.store import PostgresStore
from relay.wire.errors import ConfigError

# The package is not on the index: name the driver itself (the postgres extra).
INSTALL_HINT = "pip install 'psycopg[binary]>=3.2' in the broker's environment"
DEFAULT_POOL_SIZE = 10


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
            key, f"cannot connect: {failure_reason(e)}") from None
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
                          f"{failure_reason(e)}") from None
    try:
        conn = connect(conninfo, autocommit=True)
    except psycopg.Error as e:
        raise _standby_behind(conninfo, "broker.postgres.dsn") or ConfigError(
            "broker.postgres.dsn", f"cannot connect: {failure_reason(e)}") from None
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
        raise ConfigError("broker.postgres.dsn", f"cannot migrate the schema: {failure_reason(e)}"
                          ) from None
    finally:
        conn.close()
    if options.listen_dsn:
        # LISTEN is refused on a standby: the broker would never hear another one
        _check_writable(listen_conninfo, "broker.postgres.listenDsn")
    return PostgresStore(conninfo, listen_conninfo, options.pool_size, reactor)

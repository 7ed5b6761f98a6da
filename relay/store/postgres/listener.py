"""The connection that listens for other brokers' notifications, in its own thread."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

from twisted.logger import Logger

from relay.store.postgres.connections import connect, failure_reason
from relay.store.postgres.statements import CHANNEL

log = Logger(namespace="relay.store.postgres")

LISTEN_PROBE_SECONDS = 2.0
LISTEN_WAIT_SECONDS = 0.2
RECONNECT_SECONDS = (0.2, 0.5, 1.0, 2.0)


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
                             reason=failure_reason(e))
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

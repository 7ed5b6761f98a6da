"""Message stores: one interface (:mod:`relay.store.interface`), several backends."""

from __future__ import annotations

import os
from typing import Any, Callable

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool

from relay.wire.errors import ConfigError


def make_data_dir(data_dir: str) -> str:
    """``data_dir``, created (mode 0700, whatever the umask) if missing; ConfigError
    with the path and the reason if not. An existing directory that others may read
    is logged, by path."""
    from twisted.logger import Logger

    from relay.files.private import private_dir

    try:
        private_dir(data_dir)
    except OSError as e:
        raise ConfigError("broker.dataDir", f"cannot create {data_dir}: {e.strerror}") from None
    if os.stat(data_dir).st_mode & 0o077:
        Logger(namespace="relay.store").warn(
            "{path} can be read by other users: the stored messages are in it "
            "(chmod 700 it)", path=data_dir)
    return data_dir


def off_the_reactor(reactor: Any, work: Callable[[], Any]) -> Deferred:
    """Run ``work()`` in ``reactor``'s thread pool when the reactor provides
    ``IReactorThreads``, else at once (a test clock); fires with its result."""
    if IReactorThreads.providedBy(reactor):
        return deferToThreadPool(reactor, reactor.getThreadPool(), work)
    return maybeDeferred(work)

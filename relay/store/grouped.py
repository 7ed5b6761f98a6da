"""Group commit for the persistent backends: one durable write per reactor turn.

A backend runs each operation synchronously against its state and tells the
:class:`GroupCommit` when the operation changed something (:meth:`touch`).
The results of every operation are held back until the next commit has made
all pending changes durable, so no caller ever sees a state that a crash could
still take back: a ``201`` is sent only for a stored message. The commit runs
once per reactor turn (``callLater(0)``), so all the requests processed in one
turn share one transaction, one write and at most one fsync. ``on_commit`` runs
after each successful commit, before the held results fire.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger(namespace="relay.store")

RETRY_SECONDS = 1.0


class GroupCommit:
    """Holds operation results until the commit that covers them has run.

    ``commit`` makes every pending change durable, or raises (having undone
    or kept what it could; see the backend) — then every held result fails
    with that error instead, and the commit is tried again after
    ``RETRY_SECONDS``; results of later operations wait for that retry.
    """

    def __init__(self, clock: IReactorTime, commit: Callable[[], None], name: str,
                 on_commit: Optional[Callable[[], None]] = None) -> None:
        self.clock = clock
        self.commit = commit
        self.name = name
        self.on_commit = on_commit
        self.pending = False
        self.commits = 0
        # Why the last commit failed, until one succeeds (the store's health).
        self.failure: Optional[str] = None
        self.observers: List[Callable[[float], None]] = []
        self._held: List[Tuple[Deferred, Any, Optional[Failure]]] = []
        self._call: Optional[IDelayedCall] = None

    def touch(self) -> None:
        """Note that the state changed; the next reactor turn commits it."""
        self.pending = True
        if self._call is None:
            self._call = self.clock.callLater(0, self.flush)

    def run(self, operation: Callable[..., Any], *args: Any) -> Deferred:
        """Run ``operation(*args)`` now; its result fires once it is durable.

        When nothing is pending (a read on a committed state), the result
        fires at once. Exceptions become a failed Deferred, held the same way.
        """
        try:
            result, failure = operation(*args), None
        except Exception:
            result, failure = None, Failure()
        if not self.pending:
            return fail(failure) if failure is not None else succeed(result)
        d = Deferred()
        self._held.append((d, result, failure))
        return d

    def flush(self) -> None:
        """Commit now (if anything is pending) and release the held results."""
        if self._call is not None:
            if self._call.active():
                self._call.cancel()
            self._call = None
        held, self._held = self._held, []
        error: Optional[Failure] = None
        if self.pending:
            self.pending = False
            started = self.clock.seconds()
            try:
                self.commit()
                self.commits += 1
                self.failure = None
            except Exception:
                error = Failure()
                self.failure = f"commits are failing: {error.type.__name__}: {error.value}"
                self.pending = True
                self._call = self.clock.callLater(RETRY_SECONDS, self.flush)
                log.error(
                    "{store}: commit failed ({kind}); {count} requests fail",
                    store=self.name,
                    kind=error.type.__name__,
                    count=len(held),
                )
            if self.observers:
                elapsed = self.clock.seconds() - started
                for observe in self.observers:
                    observe(elapsed)
        if error is None and self.on_commit is not None:
            self.on_commit()
        for d, result, failure in held:
            if error is not None:
                d.errback(error)
            elif failure is not None:
                d.errback(failure)
            else:
                d.callback(result)

    def close(self) -> None:
        """Commit what is pending one last time; no retry is scheduled after this."""
        self.flush()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

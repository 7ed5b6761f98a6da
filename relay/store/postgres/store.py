"""The postgres store: the operations of IMessageStore run in worker threads, the
changes heard from other brokers, and the lockouts and nonces they share."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from zope.interface import implementer

from relay.rules.delivery import Changes, Message, Rules, Transition, WithStored
from relay.rules.events import ALL_AGENTS
from relay.store import records as ops
from relay.store.interface import IMessageStore, ISharedLockouts, ISharedNonces
from relay.store.postgres.connections import Connections, Job, Outcome, Unavailable
from relay.store.postgres.listener import Listener
from relay.store.postgres.records import (
    every_waiting_agent,
    heard,
    is_registered,
    pull,
    upcoming_deadlines,
)
from relay.store.postgres.shared import (
    PostgresLockouts,
    nonce_claim,
    nonce_claim_locked,
    nonce_forget,
)
from relay.store.records import EXPIRE_BATCH
from relay.wire import errors
from relay.wire.errors import RelayError
from relay.wire.protocol import KEEP_CARD, MAX_CLOCK_SKEW_SECONDS

log = Logger(namespace="relay.store.postgres")

OPERATION_SECONDS = 10.0
FALLBACK_SECONDS = 1.0
LISTEN_START_SECONDS = 5.0


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
        job = Job()
        job.timeout = self.clock.callLater(OPERATION_SECONDS, self._timed_out, job)

        def landed(ok: bool, outcome: Any) -> None:
            self.reactor.callFromThread(self._landed, job, ok, outcome)

        self.connections.threads.callInThreadWithCallback(
            landed, self.connections.interact, job, operation, args)
        return job.deferred

    def _timed_out(self, job: Job) -> None:
        job.abandoned = True
        job.timeout = None
        log.warn("postgres: an operation took over {seconds} s; answered busy",
                 seconds=OPERATION_SECONDS)
        job.deferred.errback(errors.busy("the database did not answer in time"))

    def _landed(self, job: Job, ok: bool, outcome: Any) -> None:
        if job.timeout is not None and job.timeout.active():
            job.timeout.cancel()
        if ok and isinstance(outcome, Outcome):
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
        self.lockouts = PostgresLockouts(self._run, self.clock, lockout)
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

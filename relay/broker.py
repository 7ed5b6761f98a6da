"""The broker: every operation of the wire protocol, applied to one store.

Routes (``relay/web.py``), sweeps (``relay/service.py``) and any other front end
call a :class:`Broker` method with an authenticated agent name and parsed
values; the broker reads policy, applies the routing ACL and the
registered-recipient rule, hands the store the transitions of
:mod:`relay.delivery`, and answers with wire-ready values.

It is also the only place that wakes waiting requests: the store reports what
its committed changes mean (:class:`relay.delivery.Changes`, to
:meth:`Broker.changed`), and the broker wakes the waiters concerned — now for
new deliverable messages, later for a lease deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay import __version__, delivery, errors, protocol
from relay.delivery import Changes, Message, Rules
from relay.ops.counters import Counters
from relay.protocol import FAILED, HEARTBEAT_TTL_SECONDS, MAX_WAIT_SECONDS
from relay.waiters import Waiters

log = Logger(namespace="relay.broker")


@dataclass(frozen=True)
class Policy:
    """The broker's delivery policy: what ``broker.*`` and ``agents.*`` decide."""

    lease_seconds: float = 600.0
    rules: Rules = Rules()
    message_ttl_seconds: float = 7 * 86400.0
    # sender -> the agents it may send to; a sender without an entry may send to anyone
    allowed_targets: Mapping[str, FrozenSet[str]] = field(default_factory=dict)
    # spec §2: a recipient must have registered (404 no_such_agent otherwise)
    registered_recipients: bool = True

    @classmethod
    def from_config(cls, config) -> Policy:
        """The policy of a :class:`relay.config.Config`."""
        return cls(
            lease_seconds=config.lease_seconds,
            rules=Rules(max_attempts=config.max_attempts),
            message_ttl_seconds=config.message_ttl_seconds,
            allowed_targets={
                name: frozenset(agent.allowed_targets)
                for name, agent in config.agents.items()
                if agent.allowed_targets is not None
            },
        )

    def check_route(self, sender: str, recipient: str) -> None:
        """403 ``forbidden`` when ``sender``'s ``allowed_targets`` omit ``recipient``."""
        targets = self.allowed_targets.get(sender)
        if targets is not None and recipient not in targets:
            raise errors.forbidden(f"agent {sender!r} is not allowed to send to {recipient!r}")


class Broker:
    """Every operation of the relay over one store, under one policy and one clock."""

    def __init__(self, store, clock: IReactorTime, policy: Optional[Policy] = None,
                 waiters: Optional[Waiters] = None, counters: Optional[Counters] = None) -> None:
        self.store = store
        self.clock = clock
        self.policy = policy if policy is not None else Policy()
        self.waiters = waiters if waiters is not None else Waiters(clock)
        # What the operations completed add up to (/metrics, the dashboard).
        self.counters = counters if counters is not None else Counters()
        store.subscribe(self.changed)

    # -- wake-ups -------------------------------------------------------------------

    def changed(self, changes: Changes) -> None:
        """Wake the waiters a committed change concerns (the store's report)."""
        for agent in changes.ready:
            self.waiters.wake(agent)
        for when, agent in changes.due:
            self.waiters.wake_at(agent, when)
        if changes.lapsed:
            self.counters.leases_lapsed(changes.lapsed)

    # -- v1.0 --------------------------------------------------------------------------

    def info(self) -> Dict[str, Any]:
        """The ``GET /`` document: protocol, broker, version, capabilities, storage."""
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "broker": protocol.BROKER_NAME,
            "version": __version__,
            "capabilities": {
                "leaseDelivery": True,
                "requestReply": True,
                "filteredQuery": True,
                "sqlitePersistence": True,
                "longPoll": {"maxWaitSeconds": MAX_WAIT_SECONDS},
            },
            "storage": self.store.name,
        }

    def register(self, agent: str) -> Deferred:
        """A heartbeat of ``agent``; fires with its time (epoch seconds)."""
        now = int(self.clock.seconds())
        d = self.store.register(agent, now)
        d.addCallback(lambda _: now)
        return d

    def peers(self) -> Deferred:
        """Fires with the ``/peers`` entries, sorted by name."""
        d = self.store.peers()
        d.addCallback(self._peer_entries)
        return d

    def _peer_entries(self, peers: Sequence[Tuple[str, int]]) -> List[Dict[str, Any]]:
        now = self.clock.seconds()
        return [
            {"agent": name, "online": now - seen < HEARTBEAT_TTL_SECONDS, "lastSeen": seen}
            for name, seen in peers
        ]

    # The hot operations (send, pull, ack) chain callbacks rather than use
    # inlineCallbacks: a generator per request is measurable at this rate.

    def send(self, agent: str, envelope: Dict[str, Any]) -> Deferred:
        """Store a normalised envelope from ``agent``; fires with True when stored,
        False for a duplicate id. Errbacks 403 (ACL) or 404 (unregistered recipient)."""
        recipient = envelope["to"]
        self.policy.check_route(agent, recipient)
        message = Message.from_envelope(envelope, self.clock.seconds())
        if not self.policy.registered_recipients:
            return self._add(message)
        registered = self.store.is_registered(recipient)
        if isinstance(registered, Deferred):  # a store that answers asynchronously
            registered.addCallback(self._add_if_registered, message)
            return registered
        return self._add_if_registered(registered, message)

    def _add_if_registered(self, registered: bool, message: Message) -> Deferred:
        if not registered:
            raise errors.no_such_agent(f"recipient {message.to!r} has never registered")
        return self._add(message)

    def _add(self, message: Message) -> Deferred:
        d = self.store.add(message)
        d.addCallback(self._stored, message)
        return d

    def _stored(self, added: bool, message: Message) -> bool:
        if added:
            self.counters.message_stored(message.sender, message.to)
        return added

    @inlineCallbacks
    def receipt(self, agent: str, message_id: str, raw_body: bytes):
        """The v1.0 receipt ``POST /messages/<id>/ack``: stores a ``type: "ack"``
        envelope back to the sender; fires with the receipt's id. The body is read
        only once the target is known to be the caller's (404 and 403 come first)."""
        target = yield self.store.find(message_id)
        if target is None:
            raise errors.no_such_message()
        if target.to != agent:
            raise errors.forbidden("only the recipient may acknowledge this message")
        body = protocol.parse_json_body(raw_body)
        envelope = protocol.ack_receipt({"id": target.id, "from": target.sender}, agent, body)
        self.policy.check_route(agent, envelope["to"])
        yield self._add(Message.from_envelope(envelope, self.clock.seconds()))
        return envelope["id"]

    def poll(self, agent: str, since: Optional[str], limit: int, wait: int) -> Deferred:
        """The v1.0 poll; fires with ``(envelopes, cursor)``. With ``wait``, waits up
        to that many seconds for a message to become deliverable."""

        def attempt() -> Deferred:
            return self.store.poll(agent, since, limit, self.clock.seconds(), self.policy.rules)

        d = self.waiters.wait_for(agent, attempt, _found_page, wait, consume=False)
        d.addCallback(self._polled, agent)
        return d

    def _polled(self, page: Tuple[List[Message], Optional[str]],
                agent: str) -> Tuple[List[Dict[str, Any]], Optional[str]]:
        messages = page[0]
        if messages:
            self.counters.messages_delivered(len(messages))
        return [m.envelope(agent) for m in messages], page[1]

    # -- v1.1 ----------------------------------------------------------------------

    def pull(self, agent: str, limit: int, lease_seconds: Optional[float],
             wait: int) -> Deferred:
        """Lease up to ``limit`` messages; fires with their envelopes (``leaseId``
        included). ``lease_seconds`` None means ``broker.leaseSeconds``."""
        seconds = self.policy.lease_seconds if lease_seconds is None else lease_seconds

        def attempt() -> Deferred:
            return self.store.pull(agent, limit, seconds, self.clock.seconds(),
                                   self.policy.rules)

        d = self.waiters.wait_for(agent, attempt, bool, wait)
        d.addCallback(self._leased, agent)
        return d

    def _leased(self, messages: List[Message], agent: str) -> List[Dict[str, Any]]:
        if messages:
            self.counters.messages_delivered(len(messages))
        return [m.envelope(agent) for m in messages]

    def ack(self, agent: str, message_id: str, lease_id: str, outcome: str,
            error: Optional[str]) -> Deferred:
        """Settle a lease (``/v1/ack``); fires with ``{ok, status, attempts}``."""
        rules = self.policy.rules
        transition = delivery.ack(agent, lease_id, outcome, error, rules)
        d = self.store.settle(message_id, transition, self.clock.seconds(), rules)
        d.addCallback(self._acked, outcome)
        return d

    def _acked(self, result: Dict[str, Any], outcome: str) -> Dict[str, Any]:
        self.counters.message_acked(outcome)
        if result["status"] == FAILED:
            self.counters.message_dead_lettered("attempts")
        return result

    def status(self, agent: str, message_ids: Sequence[str]) -> Deferred:
        """Fires with the ``/v1/status`` entries of ``message_ids``."""
        return self.store.status(message_ids, agent, self.clock.seconds(), self.policy.rules)

    def recent(self, agent: str, limit: int) -> Deferred:
        """Fires with the envelopes of ``agent``'s newest messages, any status."""
        d = self.store.recent(agent, limit, self.clock.seconds(), self.policy.rules)
        d.addCallback(lambda messages: [m.envelope(agent) for m in messages])
        return d

    def query(self, agent: str, limit: int, filters: Mapping[str, Optional[str]]) -> Deferred:
        """Fires with the envelopes of ``agent``'s messages matching ``filters``."""
        d = self.store.query(agent, limit, filters, self.clock.seconds(), self.policy.rules)
        d.addCallback(lambda messages: [m.envelope(agent) for m in messages])
        return d

    # -- sweeps ----------------------------------------------------------------------

    def sweep_leases(self) -> Deferred:
        """Release every lease past its deadline; fires with how many."""
        return self.store.sweep_leases(self.clock.seconds(), self.policy.rules)

    def sweep_expired(self) -> Deferred:
        """Remove the messages older than ``messageTtlDays``; fires with how many."""
        cutoff = self.clock.seconds() - self.policy.message_ttl_seconds
        d = maybeDeferred(self.store.sweep_expired, cutoff)

        def removed(count: int) -> int:
            if count:
                log.info("expired {count} messages", count=count)
                self.counters.messages_expired(count)
            return count

        d.addCallback(removed)
        return d

    # -- operators (the ops listener) ------------------------------------------------

    def queue_depths(self) -> Deferred:
        """Fires with the store's :class:`relay.store.interface.QueueDepth` list."""
        return self.store.queue_depths()

    def health(self) -> Deferred:
        """Fires with None while the store accepts writes, else the reason it does not."""
        return self.store.health()

    @inlineCallbacks
    def messages_in(self, status: str, limit: int):
        """Fires with the newest ``limit`` messages in ``status`` (``leased`` or
        ``failed``) to any agent, newest first: the ops views of leases in flight
        and dead letters. Only agents the queue depths show with such messages
        are read."""
        depths = yield self.store.queue_depths()
        now = self.clock.seconds()
        found: List[Message] = []
        for depth in depths:
            if getattr(depth, status):
                found += (yield self.store.query(depth.agent, limit, {"status": status},
                                                 now, self.policy.rules))
        found.sort(key=lambda m: m.seq, reverse=True)
        return found[:limit]

    def stop(self) -> None:
        """Answer every waiting request and accept no new waits."""
        self.waiters.stop()


def _found_page(page: Tuple[List[Message], Optional[str]]) -> bool:
    return bool(page[0])

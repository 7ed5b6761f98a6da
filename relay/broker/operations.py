"""The broker: every operation of the wire protocol, applied to one store.

Routes (``relay/broker/api.py``), sweeps (``relay/broker/service.py``) and any other front end
call a :class:`Broker` method with an authenticated agent name and parsed
values; the broker reads policy, applies the routing ACL and the
registered-recipient rule, hands the store the transitions of
:mod:`relay.rules.delivery`, and answers with wire-ready values.

It is also the only place that wakes waiting requests: the store reports what
its committed changes mean (:class:`relay.rules.delivery.Changes`, to
:meth:`Broker.changed`), and the broker wakes the waiters concerned — now for
new deliverable messages, later for a lease deadline.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay import __version__
from relay.broker.counters import Counters
from relay.broker.waiters import Waiters
from relay.rules import delivery
from relay.rules.delivery import Changes, Message, Rules
from relay.rules.events import KEEPALIVE_SECONDS
from relay.rules.hooks import check_url
from relay.wire import errors, protocol
from relay.wire.protocol import HEARTBEAT_TTL_SECONDS, INBOX_PATH, KEEP_CARD, MAX_WAIT_SECONDS

log = Logger(namespace="relay.broker")

# The most leased messages of one role read to count its leases by member.
ROLE_LEASES_READ = 1000


@dataclass(frozen=True)
class Policy:
    """The broker's delivery policy: what ``broker.*``, ``security.*`` and ``agents.*``
    decide (:meth:`from_config`; the defaults are the config table's)."""

    lease_seconds: float
    rules: Rules
    message_ttl_seconds: float
    # sender -> the agents it may send to; a sender without an entry may send to anyone
    allowed_targets: Mapping[str, FrozenSet[str]]
    # EXTENSIONS.md §9: requests without a signed nonce are refused
    require_nonce: bool
    # a new agent beyond this many registered ones is refused (0: no limit)
    max_agents: int
    # sends are refused (503 busy) while the store's disk has less free space (0: never)
    min_free_disk_bytes: int
    # REACH §11: how long events are kept
    event_retention_seconds: float
    # REACH §13: the configured groups and roles, by name (relay.rules.config.GroupConfig,
    # relay.rules.config.RoleConfig)
    groups: Mapping[str, Any]
    roles: Mapping[str, Any]
    # REACH §15: the agents that are people (``"human": true`` in /peers)
    humans: FrozenSet[str]

    @classmethod
    def from_config(cls, config) -> Policy:
        """The policy of a :class:`relay.rules.config.Config`."""
        return cls(
            lease_seconds=config.lease_seconds,
            rules=Rules(max_attempts=config.max_attempts, max_deliveries=config.max_deliveries,
                        notify_failures=config.notify_failures,
                        inbox_max_messages=config.inbox_max_messages,
                        inbox_max_bytes=config.inbox_max_bytes,
                        notify_v2=config.notify_failed_to_sender,
                        roles={name: delivery.Role(frozenset(role.members), role.self_join)
                               for name, role in config.roles.items()}),
            message_ttl_seconds=config.message_ttl_seconds,
            allowed_targets={
                name: frozenset(agent.allowed_targets)
                for name, agent in config.agents.items()
                if agent.allowed_targets is not None
            },
            require_nonce=config.require_nonce,
            max_agents=config.max_agents,
            min_free_disk_bytes=config.min_free_disk_mb * 1024 * 1024,
            event_retention_seconds=config.event_retention_seconds,
            groups=config.groups,
            roles=config.roles,
            humans=frozenset(name for name, agent in config.agents.items() if agent.human),
        )

    @property
    def max_ttl_seconds(self) -> int:
        """The longest ``ttlSeconds`` a send may ask for: the message TTL, in whole seconds."""
        return int(self.message_ttl_seconds)

    def check_role(self, address: str) -> str:
        """The name of the role at ``address`` (``role:NAME``); 404 ``no_such_agent``
        when no such role is configured (REACH §13)."""
        name = address[len(protocol.ROLE_PREFIX):]
        if name not in self.rules.roles:
            raise errors.no_such_agent(f"no role {name!r} is configured")
        return name

    def check_joins(self, card: Any) -> None:
        """400 when a card lists a role (``card.roles``) that is not configured or not
        open to joining (``selfJoin``)."""
        if not isinstance(card, dict):
            return
        for name in card.get("roles", ()):
            role = self.rules.roles.get(name)
            if role is None:
                raise errors.bad_request(f"card.roles: no role {name!r} is configured here")
            if not role.self_join:
                raise errors.bad_request(f"card.roles: the role {name!r} is not open to "
                                         "joining (roles.<name>.selfJoin)")

    def check_route(self, sender: str, recipient: str) -> None:
        """403 ``forbidden`` when ``sender``'s ``allowed_targets`` omit ``recipient``."""
        targets = self.allowed_targets.get(sender)
        if targets is not None and recipient not in targets:
            raise errors.forbidden(f"agent {sender!r} is not allowed to send to {recipient!r}")


class Broker:
    """Every operation of the relay over one store, under one policy and one clock."""

    def __init__(self, store, clock: IReactorTime, policy: Policy,
                 waiters: Optional[Waiters] = None, counters: Optional[Counters] = None,
                 streams: Any = None, webhooks: Any = None) -> None:
        self.store = store
        # The webhook deliveries (relay.broker.webhooks.WebhookDelivery), when the broker
        # makes them.
        self.webhooks = webhooks
        # The open event streams (relay.broker.streams.EventStreams), when the broker serves them.
        self.streams = streams
        self.clock = clock
        self.policy = policy
        self.waiters = waiters if waiters is not None else Waiters(clock)
        # What the operations completed add up to (/metrics, the dashboard).
        self.counters = counters if counters is not None else Counters()
        # When requests sent with a TTL expire (epoch seconds, on a half-second
        # grid): the expiry sweep then stores their failure notices on time. A heap,
        # and its times as a set (a TTL of an hour is 7,200 times a send looks up).
        self._expiries: List[float] = []
        self._expiring: Set[float] = set()
        self._expiry_call: Any = None
        # When delays end (epoch seconds, on a half-second grid): the store then
        # records the message events of the messages they held back.
        self._releases: List[float] = []
        self._releasing: Set[float] = set()
        self._release_call: Any = None
        # REACH §13: role -> the agents that joined it through a card registered here
        # (waking them for the role's queue; the store decides what they may lease)
        self._joined: Dict[str, set] = {}
        self._stopped = False
        store.subscribe(self.changed)

    def configure(self, policy: Policy) -> None:
        """Apply the policy of a reloaded config."""
        self.policy = policy

    # -- wake-ups -------------------------------------------------------------------

    def changed(self, changes: Changes) -> None:
        """Wake the waiters a committed change concerns (the store's report); a change
        of a role's queue concerns its members (REACH §13)."""
        waiters = self.waiters
        for address in changes.ready:
            for agent in self._concerned(address):
                waiters.wake(agent)
        for when, address in changes.held:
            for agent in self._concerned(address):
                waiters.hold(agent, when)
        for when, address in changes.released:
            for agent in self._concerned(address):
                waiters.let_go(agent, when)
        for when, address in changes.due:
            for agent in self._concerned(address):
                waiters.wake_at(agent, when)
            self._release_at(when)
        counters = self.counters
        for sender, recipient in changes.stored:
            counters.message_stored(sender, recipient)
        for reason in changes.dead:
            counters.message_dead_lettered(reason)
        if changes.lapsed:
            counters.leases_lapsed(changes.lapsed)
        for when in changes.expiring:
            self._sweep_at(when)

    def _concerned(self, address: str) -> Sequence[str]:
        """The agents whose pulls lease from the queue at ``address``: the agent, or
        a role's members by config, those that joined it here, and, for a role open
        to joining, every agent waiting now (the store knows who joined elsewhere)."""
        if not address.startswith(protocol.ROLE_PREFIX):
            return (address,)
        name = address[len(protocol.ROLE_PREFIX):]
        role = self.policy.rules.roles.get(name)
        if role is None:
            return ()
        found = set(role.members)
        if role.self_join:
            found.update(self._joined.get(name, ()))
            found.update(self.waiters.agents())
        return sorted(found)

    def _sweep_at(self, when: float) -> None:
        """Run the expiry sweep at ``when`` (rounded up to the next half second, so a
        burst of requests shares one sweep)."""
        when = math.ceil(when * 2) / 2
        if self._stopped or when in self._expiring:
            return
        self._expiring.add(when)
        heapq.heappush(self._expiries, when)
        self._schedule_expiry()

    def _schedule_expiry(self) -> None:
        if not self._expiries or self._stopped:
            return
        first = self._expiries[0]
        call = self._expiry_call
        if call is not None and call.active():
            if call.getTime() <= first:
                return
            call.cancel()
        self._expiry_call = self.clock.callLater(max(0.0, first - self.clock.seconds()),
                                                 self._expiry_due)

    def _expiry_due(self) -> None:
        self._expiry_call = None
        now = self.clock.seconds()
        while self._expiries and self._expiries[0] <= now:
            self._expiring.discard(heapq.heappop(self._expiries))
        d = self.sweep_expired()
        d.addErrback(lambda failure: log.error("expiry sweep failed: {kind}",
                                               kind=failure.type.__name__))
        d.addBoth(lambda _: self._schedule_expiry())

    def _release_at(self, when: float) -> None:
        """Release the delays ending at ``when`` (rounded up to the next half second)."""
        when = math.ceil(when * 2) / 2
        if self._stopped or when in self._releasing:
            return
        self._releasing.add(when)
        heapq.heappush(self._releases, when)
        self._schedule_release()

    def _schedule_release(self) -> None:
        if not self._releases or self._stopped:
            return
        first = self._releases[0]
        call = self._release_call
        if call is not None and call.active():
            if call.getTime() <= first:
                return
            call.cancel()
        self._release_call = self.clock.callLater(max(0.0, first - self.clock.seconds()),
                                                  self._release_due)

    def _release_due(self) -> None:
        self._release_call = None
        now = self.clock.seconds()
        while self._releases and self._releases[0] <= now:
            self._releasing.discard(heapq.heappop(self._releases))
        d = self.store.release_due(now, self.policy.rules)
        d.addErrback(lambda failure: log.error("delay release failed: {kind}",
                                               kind=failure.type.__name__))
        d.addBoth(lambda _: self._schedule_release())

    # -- v1.0 --------------------------------------------------------------------------

    def info(self) -> Dict[str, Any]:
        """The ``GET /`` document: protocol, broker, version, capabilities, storage."""
        rules = self.policy.rules
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
                "leaseRenew": True,
                "ackOutcomes": list(protocol.OUTCOMES),
                "retryAfter": {"maxSeconds": protocol.MAX_RETRY_AFTER_SECONDS},
                "deadLetters": {"maxDeliveries": rules.max_deliveries,
                                "failureNotices": rules.notify_failures},
                "replyInAck": True,
                "pullFilter": True,
                "threads": True,
                "messageTtl": {"maxSeconds": self.policy.max_ttl_seconds},
                "delayedDelivery": {"maxSeconds": protocol.MAX_DELAY_SECONDS},
                "peerCards": True,
                "signedNonce": {"required": self.policy.require_nonce},
                "events": {"retentionSeconds": int(self.policy.event_retention_seconds),
                           "keepaliveSeconds": KEEPALIVE_SECONDS},
                **({"webhooks": {"maxAttempts": self.webhooks.settings.max_attempts}}
                   if self.webhooks is not None else {}),
                "groups": True,
                # WIRE-V2 §5: the reference's v2/v3 wire on the same listener and store.
                "wireV2": {"schemes": ["v2", "v3"]},
                "humans": {"inbox": INBOX_PATH},
                "roles": True,
                "priority": {"max": protocol.MAX_PRIORITY},
            },
            "storage": self.storage(),
        }

    def register(self, agent: str, card: Any = KEEP_CARD, webhook: Any = KEEP_CARD) -> Deferred:
        """A heartbeat of ``agent``, with its peer card (None removes it,
        :data:`relay.wire.protocol.KEEP_CARD` keeps it) and its webhook URL (the same);
        fires with ``(its time in epoch seconds, the webhook shown to it or None)``.
        A URL outside ``broker.webhookAllow`` is 400 before anything is stored."""
        now = int(self.clock.seconds())
        hooks = self.webhooks
        if hooks is not None and webhook is not KEEP_CARD and webhook is not None:
            check_url(webhook, hooks.settings.allow)
        self.policy.check_joins(card)
        d = self.store.register(agent, now, card, self.policy.max_agents)
        if card is not KEEP_CARD:
            d.addCallback(self._note_joins, agent, card)
        if hooks is not None:
            d.addCallback(lambda _: hooks.register(agent, webhook, KEEP_CARD))
            d.addCallback(lambda _: (now, hooks.shown(agent)))
        else:
            d.addCallback(lambda _: (now, None))
        return d

    def _note_joins(self, result: Any, agent: str, card: Any) -> Any:
        for agents in self._joined.values():
            agents.discard(agent)
        for name in (card or {}).get("roles", ()):
            self._joined.setdefault(name, set()).add(agent)
        return result

    def peers(self) -> Deferred:
        """Fires with the ``/peers`` entries, sorted by name; ``card`` for agents that
        registered one."""
        d = self.store.peers()
        d.addCallback(self._peer_entries)
        return d

    def _peer_entries(self, peers, cards: bool = True) -> List[Dict[str, Any]]:
        now = self.clock.seconds()
        humans = self.policy.humans
        out = []
        for name, seen, card in peers:
            entry: Dict[str, Any] = {"agent": name, "online": now - seen < HEARTBEAT_TTL_SECONDS,
                                     "lastSeen": seen}
            if name in humans:
                entry["human"] = True
            if card is not None and cards:
                entry["card"] = card
            out.append(entry)
        return out

    def peers_page(self, after: Optional[str] = None, limit: Optional[int] = None,
                   cards: bool = True) -> Deferred:
        """Fires with the ``GET /peers`` answer: the peers after ``after``, at most
        ``limit`` and about 4 MiB of them, with their cards unless ``cards`` is
        False, and ``next`` when more follow (:func:`relay.wire.protocol.peers_page`)."""
        d = self.store.peers()
        d.addCallback(self._peers_document, after, limit, cards)
        return d

    def _peers_document(self, peers, after: Optional[str], limit: Optional[int],
                        cards: bool) -> Dict[str, Any]:
        document = protocol.peers_page(self._peer_entries(peers, cards), after, limit)
        return self._with_teams(document, peers)

    def _with_teams(self, document: Dict[str, Any], peers) -> Dict[str, Any]:
        """``document`` with the configured ``groups`` and ``roles`` (REACH §13), both
        lists present (one maybe empty) when the config names a group or a role (so a
        broker without teams answers the v1.2 shape). A role open to joining lists the
        peers whose card joined it after its configured members."""
        if self.policy.groups or self.policy.roles:
            document["groups"] = protocol.team_listing(self.policy.groups)
            roles = protocol.team_listing(self.policy.roles)
            joined = self._card_members(peers) if roles else {}
            for entry in roles:
                extra = sorted(joined.get(entry["name"], set()) - set(entry["members"]))
                entry["members"].extend(extra)
            document["roles"] = roles
        return document

    def _card_members(self, peers) -> Dict[str, set]:
        """Who joined each role open to joining through its stored card."""
        joined: Dict[str, set] = {}
        for name, _, card in peers:
            wanted = card.get("roles") if isinstance(card, dict) else None
            if not isinstance(wanted, list):
                continue
            for role in wanted:
                config = self.policy.roles.get(role) if isinstance(role, str) else None
                if config is not None and config.self_join:
                    joined.setdefault(role, set()).add(name)
        return joined

    # The hot operations (send, pull, ack) chain callbacks rather than use
    # inlineCallbacks: a generator per request is measurable at this rate.

    def send(self, agent: str, envelope: Dict[str, Any], ttl_seconds: Optional[int] = None,
             delay_seconds: int = 0, priority: int = 0) -> Deferred:
        """Store a normalised envelope from ``agent``; fires with True when stored,
        False for a duplicate id. A send to ``role:NAME`` is one message in that role's
        queue (REACH §13). Errbacks 400 (a TTL over the broker's), 403 (ACL), 404
        (unregistered recipient, unknown role), 429 ``inbox_full`` or 503 (disk
        nearly full)."""
        self.check_disk()
        if ttl_seconds is not None and ttl_seconds > self.policy.max_ttl_seconds:
            raise errors.bad_request(
                f"ttlSeconds must be an integer from 1 to {self.policy.max_ttl_seconds}")
        recipient = envelope["to"]
        # The ACL first, as for a group: a sender it leaves out learns nothing of roles.
        self.policy.check_route(agent, recipient)
        to_role = recipient.startswith(protocol.ROLE_PREFIX)
        if to_role:
            self.policy.check_role(recipient)
        message = Message.from_envelope(envelope, self.clock.seconds(), ttl_seconds,
                                        delay_seconds, priority)
        # The store checks that the recipient registered (spec §2) in the operation
        # that adds: one store call per send, and no window between the two.
        return self.store.add(message, self.policy.rules,
                              registered_recipient=not to_role).addErrback(self.count_refusal)

    def send_group(self, agent: str, envelope: Dict[str, Any],
                   ttl_seconds: Optional[int] = None, delay_seconds: int = 0,
                   priority: int = 0) -> Deferred:
        """Store a copy of a normalised envelope to ``group:NAME`` for each member but
        ``agent`` (REACH §13), all or none; fires with ``(stored, [(member, copy id)])``,
        ``stored`` False for a repeated send (the copies of the first). Errbacks as
        :meth:`send`; 404 ``no_such_agent`` for a group that is not configured. The
        copies carry ``priority`` (REACH §14)."""
        self.check_disk()
        if ttl_seconds is not None and ttl_seconds > self.policy.max_ttl_seconds:
            raise errors.bad_request(
                f"ttlSeconds must be an integer from 1 to {self.policy.max_ttl_seconds}")
        address = envelope["to"]
        # The ACL first, as for an agent: a sender it leaves out learns nothing of groups.
        self.policy.check_route(agent, address)
        group = self.policy.groups.get(address[len(protocol.GROUP_PREFIX):])
        if group is None:
            raise errors.no_such_agent(f"group {address!r} is not configured")
        sent = Message.from_envelope(envelope, self.clock.seconds(), ttl_seconds, delay_seconds,
                                     priority)
        copies = delivery.group_copies(sent, address, group.members)
        d = self.store.add_group(copies, agent, sent.id, self.policy.rules)
        d.addErrback(self.count_refusal)
        d.addCallback(self._group_sent, address)
        return d

    def _group_sent(self, result: Tuple[bool, List[Message]], address: str
                    ) -> Tuple[bool, List[Tuple[str, str]]]:
        stored, copies = result
        if stored:
            self.counters.group_sent(address[len(protocol.GROUP_PREFIX):])
        return stored, [(copy.to, copy.id) for copy in copies]

    def disk_low(self) -> Optional[str]:
        """Why new messages are refused for want of disk space, or None: the store's
        disk has less free space than ``broker.minFreeDiskMB``."""
        floor = self.policy.min_free_disk_bytes
        free = self.store.space_left() if floor else None
        if free is None or free >= floor:
            return None
        return (f"the broker's disk is nearly full ({free // 2**20} MB free, "
                f"broker.minFreeDiskMB is {floor // 2**20}): new messages are refused "
                "until space is freed")

    def check_disk(self) -> None:
        """503 ``busy`` (counted as a ``disk_full`` refusal) while :meth:`disk_low`."""
        reason = self.disk_low()
        if reason is not None:
            self.counters.send_refused("disk_full")
            raise errors.busy(reason)

    def count_refusal(self, failure):
        """Count an ``inbox_full`` refusal of a send; returns ``failure``."""
        if isinstance(failure.value, errors.RelayError) and failure.value.code == "inbox_full":
            self.counters.send_refused("inbox_full")
        return failure

    def limits(self) -> Dict[str, Any]:
        """The quotas in force and the disk space they watch (the ops endpoints)."""
        rules = self.policy.rules
        return {
            "inboxMaxMessages": rules.inbox_max_messages,
            "inboxMaxBytes": rules.inbox_max_bytes,
            "maxAgents": self.policy.max_agents,
            "minFreeDiskBytes": self.policy.min_free_disk_bytes,
            "diskFreeBytes": self.disk_free(),
            "sendsRefused": self.disk_low(),
        }

    def receipt(self, agent: str, message_id: str, raw_body: bytes) -> Deferred:
        """The v1.0 receipt ``POST /messages/<id>/ack``: stores a ``type: "ack"``
        envelope back to the sender (:func:`relay.rules.delivery.receipt`, one store
        operation); fires with the receipt's id. The body is read only once the
        target is known to be the caller's (404 and 403 come first)."""
        transition = delivery.receipt(agent, raw_body, self.policy.check_route,
                                      self.disk_low())
        d = self.store.settle(message_id, transition, self.clock.seconds(), self.policy.rules)
        d.addErrback(self._count_disk_refusal)
        return d

    def poll(self, agent: str, since: Optional[str], limit: int, wait: int) -> Deferred:
        """The v1.0 poll; fires with ``(envelopes, cursor)`` (each envelope JSON text).
        With ``wait``, waits up to that many seconds for a message to become
        deliverable."""

        def attempt() -> Deferred:
            return self.store.poll(agent, since, limit, self.clock.seconds(), self.policy.rules)

        d = self.waiters.wait_for(agent, attempt, _found_page, wait, consume=False)
        d.addCallback(lambda page: (self._delivered(page[0], agent), page[1]))
        return d

    # -- v1.1 ----------------------------------------------------------------------

    def pull(self, agent: str, limit: int, lease_seconds: Optional[float], wait: int,
             parent_id: Optional[str] = None, role: Optional[str] = None) -> Deferred:
        """Lease up to ``limit`` messages from ``agent``'s queue and those of its roles,
        higher priority first (with ``parent_id``: only the answers to that message;
        with ``role``: only that role's queue); fires with their envelopes as JSON
        texts (``leaseId`` included). ``lease_seconds`` None means
        ``broker.leaseSeconds``. A ``role`` that is not configured is 404
        ``no_such_agent``, one ``agent`` does not hold 403 ``forbidden``."""
        seconds = self.policy.lease_seconds if lease_seconds is None else lease_seconds
        if role is not None:
            self.policy.check_role(protocol.ROLE_PREFIX + role)

        def attempt() -> Deferred:
            if role is None:  # as a store that predates roles takes it
                return self.store.pull(agent, limit, seconds, self.clock.seconds(),
                                       self.policy.rules, parent_id)
            return self.store.pull(agent, limit, seconds, self.clock.seconds(),
                                   self.policy.rules, parent_id, role)

        # A pull by parent waits for one answer, so any new message of the agent may
        # be it: such a waiter looks at every wake-up instead of taking one in turn.
        d = self.waiters.wait_for(agent, attempt, bool, wait, consume=parent_id is None)
        d.addCallback(self._delivered, agent)
        return d

    def _envelopes(self, messages: Sequence[Message], agent: str) -> List[str]:
        """The envelopes as ``agent`` sees them now, each as JSON text: a stored body
        is sent as stored, never decoded."""
        now = self.clock.seconds()
        return [m.envelope_json(agent, now) for m in messages]

    def _delivered(self, messages: Sequence[Message], agent: str) -> List[str]:
        if messages:
            self.counters.messages_delivered(len(messages))
        return self._envelopes(messages, agent)

    def ack(self, agent: str, request: protocol.AckRequest) -> Deferred:
        """Settle a lease (``/v1/ack``): every outcome, retry-after, and the atomic
        reply; fires with ``{ok, status, attempts}`` (+ ``replyId``, ``duplicate``)."""
        rules = self.policy.rules
        reply = request.reply
        transition = delivery.ack(agent, request.lease_id, request.outcome, request.error,
                                  rules, request.retry_after, reply, self.policy.check_route,
                                  None if reply is None else self.disk_low())
        d = self.store.settle(request.message_id, transition, self.clock.seconds(), rules)
        if reply is not None:
            d.addErrback(self._count_disk_refusal)
        d.addCallback(self._acked, request.outcome)
        return d

    def _count_disk_refusal(self, failure):
        if failure.check(delivery.NewMessagesRefused):
            self.counters.send_refused("disk_full")
        return failure

    def _acked(self, result: Dict[str, Any], outcome: str) -> Dict[str, Any]:
        self.counters.message_acked(outcome)
        return result

    def renew(self, agent: str, message_id: str, lease_id: str,
              lease_seconds: Optional[int]) -> Deferred:
        """Move a lease's deadline to now + ``lease_seconds`` (``broker.leaseSeconds``
        when None); fires with ``{ok, leaseId, leaseUntil}``."""
        seconds = self.policy.lease_seconds if lease_seconds is None else lease_seconds
        return self.store.settle(message_id, delivery.renew(agent, lease_id, seconds),
                                 self.clock.seconds(), self.policy.rules)

    def requeue(self, agent: Optional[str], message_id: str) -> Deferred:
        """Put a failed message back (``/v1/requeue``); ``agent`` None is the operator,
        who may also requeue a dead letter of the v2/v3 wire kept past its TTL (it is
        listed and counted with the others)."""
        transition = delivery.requeue(agent)
        return self.store.settle(message_id, transition if agent is not None else
                                 delivery.Kept(transition), self.clock.seconds(),
                                 self.policy.rules)

    def cancel(self, agent: Optional[str], message_id: str, reason: Optional[str]) -> Deferred:
        """Withdraw a queued or leased message (``/v1/cancel``); ``agent`` None is the
        operator."""
        return self.store.settle(message_id, delivery.cancel(agent, reason),
                                 self.clock.seconds(), self.policy.rules)

    def status(self, agent: str, message_ids: Sequence[str]) -> Deferred:
        """Fires with the ``/v1/status`` entries of ``message_ids``."""
        return self.store.status(message_ids, agent, self.clock.seconds(), self.policy.rules)

    def recent(self, agent: str, limit: int) -> Deferred:
        """Fires with the envelopes (JSON texts) of ``agent``'s newest messages."""
        d = self.store.recent(agent, limit, self.clock.seconds(), self.policy.rules)
        d.addCallback(self._envelopes, agent)
        return d

    def query(self, agent: str, limit: int, filters: Mapping[str, Optional[str]]) -> Deferred:
        """Fires with the envelopes (JSON texts) of ``agent``'s messages matching
        ``filters``."""
        d = self.store.query(agent, limit, filters, self.clock.seconds(), self.policy.rules)
        d.addCallback(self._envelopes, agent)
        return d

    def thread(self, agent: str, root_id: str, since: Optional[str], limit: int) -> Deferred:
        """Fires with ``(envelopes, cursor)`` of the conversation ``root_id`` as
        ``agent`` took part in it, oldest first."""
        d = self.store.thread(agent, root_id, since, limit, self.clock.seconds(),
                              self.policy.rules)
        d.addCallback(lambda page: (self._envelopes(page[0], agent), page[1]))
        return d

    # -- sweeps ----------------------------------------------------------------------

    def sweep_leases(self) -> Deferred:
        """Release every lease past its deadline, and every delay that ended (their
        events: a timer lost to a restart is made up here); fires with how many
        leases."""
        now = self.clock.seconds()
        d = self.store.sweep_leases(now, self.policy.rules)
        d.addCallback(lambda count: self.store.release_due(now, self.policy.rules)
                      .addCallback(lambda _: count))
        return d

    def sweep_expired(self) -> Deferred:
        """Remove the messages older than ``messageTtlDays`` or past their own TTL;
        fires with how many."""
        now = self.clock.seconds()
        cutoff = now - self.policy.message_ttl_seconds
        d = maybeDeferred(self.store.sweep_expired, cutoff, now, self.policy.rules)

        def removed(count: int) -> Deferred:
            if count:
                log.info("expired {count} messages", count=count)
                self.counters.messages_expired(count)
            trimming = self.store.trim_events(now - self.policy.event_retention_seconds)
            trimming.addCallback(lambda _: forget())
            return trimming

        def forget() -> Deferred:
            # Agents offline for longer than messages live (never while they may be
            # online) and with nothing addressed to them are forgotten.
            offline = max(self.policy.message_ttl_seconds, HEARTBEAT_TTL_SECONDS)
            forgetting = self.store.forget_peers(now - offline)
            forgetting.addCallback(self._forgotten)
            return forgetting

        d.addCallback(lambda count: removed(count).addCallback(lambda _: count))
        return d

    def _forgotten(self, agents: List[str]) -> None:
        if agents:
            log.info("forgot {count} agents offline for longer than the message TTL",
                     count=len(agents))

    # -- operators (the ops listener) ------------------------------------------------

    def storage(self) -> str:
        """The store's name (``GET /``'s ``storage``)."""
        return self.store.name

    def disk_free(self) -> Optional[int]:
        """The bytes free where the store writes, or None when the broker cannot tell."""
        return self.store.space_left()

    def event_streams(self) -> Dict[str, int]:
        """Open event streams per agent."""
        return self.streams.counts() if self.streams is not None else {}

    def webhook_health(self) -> Dict[str, Dict[str, Any]]:
        """Webhook health per agent (last delivered, failing since, disabled): no URL."""
        return self.webhooks.health() if self.webhooks is not None else {}

    def waiting(self) -> int:
        """How many requests wait for messages now (``/v1/pull`` ``waitSeconds`` and
        ``GET /messages`` ``wait``)."""
        return self.waiters.count()

    def queue_depths(self, settled: Optional[Sequence[str]] = None) -> Deferred:
        """Fires with the store's :class:`relay.store.interface.QueueDepth` list (with
        ``settled``, of those agents, counting their done and expired messages too)."""
        if settled is not None:
            return self.store.queue_depths(self.clock.seconds(), settled)
        return self.store.queue_depths(self.clock.seconds())

    def health(self) -> Deferred:
        """Fires with None while the store accepts writes, else the reason it does not."""
        return self.store.health()

    @inlineCallbacks
    def messages_in(self, status: str, limit: int):
        """Fires with the newest ``limit`` messages in ``status`` (``leased`` or
        ``failed``) to any agent, newest first: the ops views of leases in flight
        and dead letters, as the depths count them (a message of the v2/v3 wire past
        its TTL is kept, and counted). Only agents the queue depths show with such
        messages are read."""
        depths = yield self.queue_depths()
        now = self.clock.seconds()
        found: List[Message] = []

        def counted(message: Message) -> bool:
            return delivery.outlives_ttl(message) or not delivery.expired(message, now)

        for depth in depths:
            if getattr(depth, status):
                found += (yield self.store.query(depth.agent, limit, {"status": status},
                                                 now, self.policy.rules, match=counted))
        found.sort(key=lambda m: m.seq, reverse=True)
        return found[:limit]

    @inlineCallbacks
    def role_queues(self, limit: int = ROLE_LEASES_READ):
        """Fires with one entry per configured role (REACH §13), by name: its members
        by config, ``selfJoin``, its queue's depth and its leases by member
        (``leasesBy``, counted over its newest ``limit`` leased messages); for the
        dashboard and the metrics."""
        depths = {depth.agent: depth for depth in (yield self.queue_depths())}
        now = self.clock.seconds()
        out = []
        for name, role in sorted(self.policy.rules.roles.items()):
            depth = depths.get(protocol.ROLE_PREFIX + name)
            by_member: Dict[str, int] = {}
            if depth is not None and depth.leased:
                leased = yield self.store.query(protocol.ROLE_PREFIX + name, limit,
                                                {"status": protocol.LEASED}, now,
                                                self.policy.rules)
                for message in leased:
                    if message.holder is not None:
                        by_member[message.holder] = by_member.get(message.holder, 0) + 1
            entry: Dict[str, Any] = {"name": name, "members": sorted(role.members),
                                     "selfJoin": role.self_join}
            for state in ("queued", "leased", "delayed", "failed"):
                entry[state] = getattr(depth, state) if depth is not None else 0
            entry["leasesBy"] = dict(sorted(by_member.items()))
            out.append(entry)
        return out

    def stop(self) -> None:
        """Answer every waiting request and accept no new waits."""
        self._stopped = True
        for call in (self._expiry_call, self._release_call):
            if call is not None and call.active():
                call.cancel()
        self._expiries.clear()
        self._expiring.clear()
        self._releases.clear()
        self._releasing.clear()
        self.waiters.stop()
        if self.streams is not None:
            self.streams.stop()


def _found_page(page: Tuple[List[Message], Optional[str]]) -> bool:
    return bool(page[0])

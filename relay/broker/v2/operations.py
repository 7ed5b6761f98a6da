"""Every operation of the v2/v3 wire, applied to the broker's one store.

:class:`Wire2` is to the v2 routes (:mod:`relay.broker.v2.api`) what
:class:`relay.broker.operations.Broker` is to the seed-wire routes: it takes an
authenticated agent and parsed values, applies the per-mode ACL, hands the store
the transitions of :mod:`relay.rules.v2.transitions`, and answers with the views of
:mod:`relay.wire.v2.views`. Messages either wire stored are read alike (WIRE-V2 §3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence

from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.logger import Logger

from relay import __version__
from relay.broker.operations import Broker
from relay.rules import delivery
from relay.rules.config import AgentConfig, Config, may_send
from relay.rules.delivery import Message
from relay.rules.v2 import transitions
from relay.wire import errors, protocol
from relay.wire.protocol import EXPIRED, FAILED, HEARTBEAT_TTL_SECONDS, LEASED, QUEUED
from relay.wire.v2 import views

log = Logger(namespace="relay.wire2")

RECENT_SECONDS = 7 * 86400
# How often a v2 agent's requests refresh its registration (its /peers lastSeen):
# one store write per agent in this many seconds, not one per request.
SEEN_REFRESH_SECONDS = 30.0
MAX_SEEN = 10_000
# The v2 statuses /v1/admin/status lists.
STUCK = ("queued", "leased", "failed", "expired")
_ALL = {"box": "all", "kind": None, "status": None, "from": None, "to": None,
        "rootId": None, "parentId": None}


@dataclass(frozen=True)
class ModeACL:
    """Who may send what on the v2/v3 wire: the per-mode routing ACL of PROTOCOL-V2
    §5.1 over ``agents.*`` (:func:`relay.rules.config.may_send`), and the
    ``security.admin_agents`` who may requeue or cancel any message."""

    agents: Mapping[str, AgentConfig]
    admins: FrozenSet[str] = frozenset()

    @classmethod
    def from_config(cls, config: Config) -> ModeACL:
        return cls(dict(config.agents), frozenset(config.admin_agents))

    def allows(self, sender: str, recipient: str, mode: str) -> bool:
        return may_send(self.agents, sender, recipient, mode)


class Send(NamedTuple):
    """A parsed ``POST /v1/messages`` body (PROTOCOL-V2 §5), its values clamped (a
    tuple: one is built per send, and a frozen dataclass costs a call per field)."""

    origin: str
    target: str
    kind: str
    body: str
    session_ref: str
    idempotency_key: str
    parent_id: Optional[str]
    root_id: Optional[str]
    execution_mode: str
    allow_shared_write: bool
    ttl_seconds: int
    context: str
    topic: str


@dataclass(frozen=True)
class Query:
    """The filters of ``POST /v1/messages/query`` (each None: any)."""

    message_id: Optional[str] = None
    root_id: Optional[str] = None
    origin: Optional[str] = None
    target: Optional[str] = None
    kind: Optional[str] = None
    status: Optional[str] = None
    topic: Optional[str] = None
    since: Optional[float] = None


class Wire2:
    """The v2/v3 operations over ``broker``'s store, policy and clock."""

    def __init__(self, broker: Broker, acl: ModeACL) -> None:
        self.broker = broker
        self.acl = acl
        self.last_pull_at: Dict[str, float] = {}
        self._seen: Dict[str, float] = {}
        self.created = 0
        self.pulls = 0

    def configure(self, acl: ModeACL) -> None:
        """Apply the ACL of a reloaded config."""
        self.acl = acl

    @property
    def store(self):
        return self.broker.store

    def _now(self) -> float:
        return self.broker.clock.seconds()

    def _ttl(self) -> float:
        return self.broker.policy.message_ttl_seconds

    def seen(self, agent: str) -> Optional[Deferred]:
        """Count ``agent`` as registered (WIRE-V2 §3: an authenticated v2/v3 request
        registers it for the seed wire's ``no_such_agent`` rule and ``/peers``);
        a Deferred when its registration is written now, None when it is fresh."""
        now = self._now()
        last = self._seen.get(agent)
        if last is not None and now - last < SEEN_REFRESH_SECONDS:
            return None
        if len(self._seen) >= MAX_SEEN:
            self._seen.clear()
        self._seen[agent] = now
        return self.store.register(agent, int(now), protocol.KEEP_CARD,
                                   self.broker.policy.max_agents)

    # -- messages --------------------------------------------------------------------

    def send(self, agent: str, send: Send) -> Deferred:
        """Store a v2 request or reply of ``agent`` (its ``origin``); fires with
        ``(message_id, created)``."""
        self.broker.check_disk()
        if send.kind == "request":
            if send.execution_mode not in views.EXECUTION_MODES:
                raise errors.bad_request("execution_mode must be read, continue, or write")
            if not self.acl.allows(agent, send.target, send.execution_mode):
                raise errors.forbidden(
                    f"target is not allowed for {send.execution_mode} mode")
            return self._store(send, send.root_id or os.urandom(16).hex(), None,
                               send.execution_mode, send.session_ref, send.topic,
                               send.allow_shared_write)
        if not send.parent_id:
            raise errors.bad_request("reply requires parent_id")
        d = self.store.find(send.parent_id, self._now(), True)
        d.addCallback(self._reply_to, send)
        return d

    def _reply_to(self, parent: Optional[Message], send: Send) -> Deferred:
        if parent is None:
            raise errors.no_such_message("parent relay message was not found")
        if parent.to != send.origin or parent.sender != send.target:
            raise errors.forbidden("reply is not authorized for this message")
        mode, session_ref, _ = views.read_meta(parent)
        return self._store(send, parent.root_id or parent.id, parent.id, mode, session_ref,
                           views.topic_of(parent), False)

    def _store(self, send: Send, root_id: str, parent_id: Optional[str], mode: str,
               session_ref: str, topic: str, shared: bool) -> Deferred:
        now = self._now()
        message_id = views.message_id_for(send.origin, send.idempotency_key)
        body = views.stored_body(send.body, send.context, topic, mode, session_ref)
        message = Message(
            id=message_id,
            sender=send.origin,
            to=send.target,
            created=now,
            body_json=views.canonical_json(body),
            kind=send.kind,
            root_id=root_id,
            parent_id=parent_id,
            reply_to=parent_id,
            expires_at=now + send.ttl_seconds,
            v2=views.v2_meta(mode, session_ref, shared),
        )
        d = self.store.add(message, self.broker.policy.rules)
        d.addErrback(self.broker.count_refusal)
        d.addCallback(self._added, message_id)
        return d

    def _added(self, added: bool, message_id: str) -> Any:
        if added:
            self.created += 1
        return message_id, added

    def pull(self, agent: str, limit: int, lease_seconds: Optional[float]) -> Deferred:
        """Lease up to ``limit`` queued messages to ``agent``; fires with their views."""
        now = self._now()
        self.last_pull_at[agent] = now
        self.pulls += 1
        seconds = self.broker.policy.lease_seconds if lease_seconds is None else lease_seconds
        d = self.store.pull(agent, limit, seconds, now, self.broker.policy.rules)
        d.addCallback(self._pulled, agent)
        return d

    def _pulled(self, messages: Sequence[Message], agent: str) -> List[Dict[str, Any]]:
        if messages:
            self.broker.counters.messages_delivered(len(messages))
        ttl = self._ttl()
        return [views.public_view(m, agent, ttl) for m in messages]

    def _settle(self, message_id: str, transition, unknown: errors.RelayError) -> Deferred:
        d = self.store.settle(message_id, transition, self._now(), self.broker.policy.rules)

        def unknown_id(failure):
            failure.trap(errors.RelayError)
            if failure.value.code == "no_such_message" and failure.value.message == \
                    errors.no_such_message().message:
                raise unknown
            return failure

        d.addErrback(unknown_id)
        return d

    def ack(self, agent: str, message_id: str, outcome: str, error: Optional[str],
            lease_token: str) -> Deferred:
        """Settle a lease (``completed`` or ``retry``); fires with ``{"ok": true}``."""
        transition = transitions.ack(agent, lease_token, outcome, error,
                                     self.broker.policy.rules)
        d = self._settle(message_id, transition,
                         errors.forbidden("message is not assigned to this agent"))
        d.addCallback(self._acked, outcome)
        return d

    def _acked(self, result: Dict[str, Any], outcome: str) -> Dict[str, Any]:
        self.broker.counters.message_acked(outcome)
        return result

    def renew(self, agent: str, message_id: str, lease_token: str,
              lease_seconds: float) -> Deferred:
        """Extend an active lease; fires with ``{"ok": true, "lease_until": s}``."""
        return self._settle(message_id, transitions.renew(agent, lease_token, lease_seconds),
                            transitions.lease_mismatch())

    def requeue(self, agent: str, message_id: str) -> Deferred:
        """An admin's requeue; logged once done (the id escaped, as a client chose it)."""
        d = self._settle(message_id, transitions.requeue(agent, agent in self.acl.admins),
                         errors.no_such_message("message was not found"))
        d.addCallback(_logged, "requeue", message_id, agent)
        return d

    def cancel(self, agent: str, message_id: str) -> Deferred:
        """An admin's cancel; logged once done (the id escaped, as a client chose it)."""
        d = self._settle(message_id, transitions.cancel(agent, agent in self.acl.admins),
                         errors.no_such_message("message was not found"))
        d.addCallback(_logged, "cancel", message_id, agent)
        return d

    # -- reads ------------------------------------------------------------------------

    @inlineCallbacks
    def status(self, agent: str, message_ids: Sequence[str]):
        """Fires with one status entry per id (``not_found`` for ids ``agent``
        neither sent nor received)."""
        now = self._now()
        ttl, rules = self._ttl(), self.broker.policy.rules
        out = []
        for message_id in message_ids:
            message = yield self.store.find(message_id, now, True)
            if message is None or agent not in (message.sender, message.to, message.lessee()):
                out.append(views.not_found(message_id))
                continue
            delivery.catch_up(message, now, rules)  # a lapsed lease, as a read sees it
            out.append(views.summary(message, ttl, now))
        return out

    def recent(self, agent: str, limit: int) -> Deferred:
        """Fires with the summaries of ``agent``'s newest messages (last 7 days)."""
        now = self._now()
        d = self.store.query(agent, limit, _ALL, now, self.broker.policy.rules,
                             match=lambda message: views.visible(message, now))
        d.addCallback(self._summaries, now, now - RECENT_SECONDS, False)
        return d

    def _summaries(self, messages: Sequence[Message], now: float, cutoff: float,
                   body: bool) -> List[Dict[str, Any]]:
        ttl = self._ttl()
        out = []
        for message in messages:
            if message.created < cutoff:
                continue
            entry = views.summary(message, ttl, now)
            if body:
                entry["body"] = views.shown_body(message)[0]
            out.append(entry)
        return out

    @inlineCallbacks
    def query(self, agent: str, limit: int, query: Query):
        """Fires with the newest ``limit`` messages of ``agent`` (either side) matching
        ``query``, newest first, with their bodies: the store reads on until it has
        ``limit`` of them or none is left."""
        now = self._now()
        rules = self.broker.policy.rules

        def matches(message: Message) -> bool:
            return (views.visible(message, now)
                    and (query.root_id is None
                         or (message.root_id or message.id) == query.root_id)
                    and (query.origin is None or message.sender == query.origin)
                    and (query.target is None or message.to == query.target)
                    and (query.kind is None or views.kind_of(message) == query.kind)
                    and (query.status is None or views.status_of(message, now) == query.status)
                    and (query.topic is None or query.topic in views.topic_of(message))
                    and (query.since is None or message.created >= query.since))

        if query.message_id is not None:
            found = yield self.store.find(query.message_id, now, True)
            candidates = [found] if found is not None and agent in (found.sender,
                                                                    found.to) else []
            found = [message for message in candidates if matches(message)]
        else:
            if (query.status is not None and query.status not in views.STATUSES) or (
                    query.kind is not None and query.kind not in ("request", "reply")):
                return []  # matches nothing
            # What the store has an index for narrows its reads; ``matches`` decides.
            filters = dict(_ALL, status=views.stored_status(query.status or ""),
                           rootId=query.root_id, kind="reply" if query.kind == "reply" else None,
                           **{"from": query.origin, "to": query.target})
            found = yield self.store.query(agent, limit, filters, now, rules, match=matches)
        return self._summaries(found, now, float("-inf"), True)

    @inlineCallbacks
    def stuck(self, agent: str, limit: int):
        """Fires with the unfinished messages to ``agent`` (queued, leased, failed,
        expired; last 7 days), newest first, each with a ``body_preview``."""
        now = self._now()
        rules = self.broker.policy.rules

        def unfinished(message: Message) -> bool:
            return views.visible(message, now) and views.status_of(message, now) in STUCK

        found: List[Message] = []
        for status in (QUEUED, LEASED, FAILED, EXPIRED):
            found += yield self.store.query(agent, limit, dict(_ALL, box="inbox",
                                                               status=status), now, rules,
                                            match=unfinished)
        found.sort(key=lambda m: m.seq, reverse=True)
        ttl = self._ttl()
        out = []
        for message in found:
            if message.created < now - RECENT_SECONDS:
                continue
            entry = views.summary(message, ttl, now)
            entry["body_preview"] = views.shown_body(message)[0][:120]
            out.append(entry)
            if len(out) >= limit:
                break
        return out

    # -- /healthz ---------------------------------------------------------------------

    def health(self, signed: bool, configured: Sequence[str] = ()) -> Deferred:
        """The ``GET /healthz`` document: without a signature only the broker's
        identity (WIRE-V2 §2), with one the roster and queues too."""
        document: Dict[str, Any] = {
            "ok": True,
            "protocol_version": views.PROTOCOL_VERSION,
            "broker": protocol.BROKER_NAME,
            "version": __version__,
            "storage": self.broker.storage(),
            "signature_schemes": ["v2", "v3"],
        }
        if not signed:
            return succeed(document)

        @inlineCallbacks
        def roster():
            peers = yield self.store.peers()
            now = self._now()
            online = {name for name, seen, _ in peers if now - seen < HEARTBEAT_TTL_SECONDS}
            agents = sorted(online | set(configured))
            depths = yield self.broker.queue_depths(settled=agents)
            # The reference's queueStats: each agent's messages by status (a delayed
            # message is queued), and when its oldest queued one was stored.
            queues = {name: {"queued": 0, "leased": 0, "completed": 0, "failed": 0,
                             "expired": 0, "oldest_queued_at": None} for name in agents}
            for depth in depths:
                if depth.agent in queues:
                    queues[depth.agent] = {"queued": depth.queued + depth.delayed,
                                           "leased": depth.leased, "completed": depth.done,
                                           "failed": depth.failed, "expired": depth.expired,
                                           "oldest_queued_at": depth.oldest_queued}
            document.update(agents=agents, queues=queues,
                            last_pull_at=dict(self.last_pull_at),
                            counters={"messages_created": self.created,
                                      "pulls": self.pulls})
            return document

        return roster()


__all__ = ["Wire2", "ModeACL", "Send", "Query"]


def _logged(result: Any, action: str, message_id: str, agent: str) -> Any:
    """Log an admin action that was done; pass its result on."""
    log.info("admin {action} {message_id} by {agent}", action=action,
             message_id=protocol.loggable(message_id), agent=agent)
    return result

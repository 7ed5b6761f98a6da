"""The store contract written once, over a backend's synchronous primitives.

A backend provides :class:`Records`: a few indexed, synchronous reads and writes
of message rows and peers. The operations below apply the rules of
:mod:`relay.rules.delivery` to them — the lapsed-lease release before every read, the
v1.0 page with its recovery deliveries, leasing, "persist whatever a transition
changed", and what each change means for waiting requests — so no backend
writes a delivery rule of its own. :class:`RecordStore` runs them as an
:class:`~relay.store.interface.IMessageStore`, either at once (memory) or
through a :class:`~relay.store.grouped.GroupCommit` (the persistent backends).
"""

from __future__ import annotations

import json
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from twisted.internet.defer import Deferred, fail, inlineCallbacks, succeed
from zope.interface import implementer

from relay.rules import delivery, events
from relay.rules.delivery import Changes, Message, Rules, Transition, WithStored
from relay.rules.events import Event, EventPage
from relay.store.grouped import GroupCommit
from relay.store.interface import IMessageStore, QueueDepth
from relay.wire import errors
from relay.wire.protocol import KEEP_CARD

EXPIRE_BATCH = 2000
# The row of the webhook states that names the broker delivering webhooks (no agent
# has this name).
WEBHOOK_LEADER = "*"
# The most bytes of messages one answer carries (at least one message, whatever its
# size): a listing of large bodies is cut short instead of held whole in memory.
RESPONSE_BUDGET_BYTES = 4 * 1024 * 1024

Listener = Callable[[Changes], None]
# A predicate a listing applies to the messages it reads (Records.listing).
Match = Callable[[Message], bool]


class Raced(Exception):
    """A message an operation read as absent was stored by another writer before the
    operation stored its own under that id: the operation is run again on fresh rows.
    Only a store that several brokers write can meet it (``relay.store.postgres``)."""



class RoleJoins:
    """Who joined each role through its peer card (``card.roles``, REACH §13 selfJoin),
    for the stores that hold their peers' cards in this process."""

    def __init__(self) -> None:
        self._by_role: Dict[str, Set[str]] = {}

    def joiners(self, role: str) -> List[str]:
        return sorted(self._by_role.get(role, ()))

    def set_card(self, agent: str, card: Optional[Dict[str, Any]]) -> None:
        """``agent``'s card is now ``card`` (None: it has none): it is a joiner of the
        roles that card lists, and of no other."""
        self.forget((agent,))
        for role in (card or {}).get("roles", ()):
            self._by_role.setdefault(role, set()).add(agent)

    def forget(self, agents: Iterable[str]) -> None:
        gone = set(agents)
        for role in list(self._by_role):
            self._by_role[role] -= gone
            if not self._by_role[role]:
                del self._by_role[role]

class Records:
    """A backend's synchronous primitives. Messages handed out are copies owned by
    the caller; :meth:`save` writes their delivery state back. Listings leave out
    messages whose ``ttlSeconds`` ran out (:func:`relay.rules.delivery.expired`), and may
    stop before ``limit`` once they hold :data:`RESPONSE_BUDGET_BYTES` (the
    operations cut them there anyway).

    ``changes`` collects what the operations' writes mean for waiting requests
    until the store reports them.
    """

    def __init__(self) -> None:
        self.changes = Changes()

    def insert(self, message: Message) -> bool:
        """Store a new message under the next sequence number (set on ``message``);
        False, writing nothing, when its id exists."""
        raise NotImplementedError

    def get(self, message_id: str) -> Optional[Message]:
        """The message of that id (expired or not), or None."""
        raise NotImplementedError

    def seq_of(self, message_id: str) -> int:
        """The sequence number of that id; 0 when unknown."""
        raise NotImplementedError

    def copies(self, sent_id: str) -> List[Message]:
        """The group copies (REACH §13) whose ``sent_id`` is that id, expired or not,
        from any sender, from an index."""
        raise NotImplementedError

    def save(self, messages: Sequence[Message], befores: Sequence[Tuple[Any, ...]]) -> None:
        """Persist the delivery state (:meth:`Message.state`) of messages got from here;
        ``befores`` are their states when they were got."""
        raise NotImplementedError

    def usage(self, agent: str) -> Tuple[int, int]:
        """The messages waiting for ``agent`` (queued or leased): how many, and the
        UTF-8 bytes of their bodies. From counters or an index, never a scan of the
        agent's whole inbox."""
        raise NotImplementedError

    def agent_count(self) -> int:
        """How many agents are registered."""
        raise NotImplementedError

    def forget(self, cutoff: float) -> List[str]:
        """Forget the registered agents last seen before ``cutoff`` that no message is
        addressed to (one kept as expired does not count); returns their names."""
        raise NotImplementedError

    def queued(self, agent: str, after_seq: int, limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        """Deliverable messages to ``agent`` (:func:`relay.rules.delivery.deliverable`) with
        a sequence after ``after_seq``, in order; with ``parent_id``, only those
        whose ``parent_id`` or ``reply_to`` equals it."""
        raise NotImplementedError

    def ranked(self, queues: Sequence[str], limit: int, now: float,
               parent_id: Optional[str] = None) -> List[Message]:
        """Up to ``limit`` deliverable messages addressed to any of ``queues`` (an
        agent, role addresses), in the order a pull leases (:func:`relay.rules.delivery.rank`:
        higher priority first, then by sequence); with ``parent_id``, only those whose
        ``parent_id`` or ``reply_to`` equals it. Flat-cost at any depth: from an index
        of the queued messages above priority 0 and the queue in sequence order."""
        raise NotImplementedError

    def card(self, agent: str) -> Optional[Dict[str, Any]]:
        """``agent``'s peer card, or None."""
        raise NotImplementedError

    def joiners(self, role: str) -> List[str]:
        """The agents whose card lists ``role`` in its ``roles`` (REACH §13 selfJoin)."""
        raise NotImplementedError

    def recovered(self, agent: str, upto_seq: int, limit: int, now: float) -> List[Message]:
        """Deliverable messages to ``agent`` at or before ``upto_seq`` that carry the
        v1.0 recovery mark, in order."""
        raise NotImplementedError

    def lapsed(self, now: float) -> List[Message]:
        """Leased messages whose lease deadline has passed."""
        raise NotImplementedError

    def held_due(self, now: float, limit: int) -> List[Message]:
        """Up to ``limit`` queued messages whose ``not_before`` is set and has passed by
        ``now`` (a delay that ended), earliest first."""
        raise NotImplementedError

    def listing(self, agent: str, box: str, limit: int, filters: Mapping[str, Optional[str]],
                now: float, match: Optional[Match] = None) -> List[Message]:
        """The newest ``limit`` messages of ``agent``'s ``box`` (``inbox``: to it,
        ``sent``: from it, ``all``: either) matching ``filters`` (``kind``,
        ``status`` — a status of :data:`relay.wire.protocol.STORED_STATUSES` —, ``from``,
        ``to``, ``rootId`` — the message's id or root id —, ``parentId`` — its parent
        id or reply-to —; None matches anything), newest first.

        With ``match``, only messages for which ``match(message)`` is true count
        toward ``limit``, however many others are read on the way; and the messages
        past their TTL are not left out: ``match`` decides about them too."""
        raise NotImplementedError

    def thread(self, agent: str, root_id: str, after_seq: int, limit: int,
               now: float) -> List[Message]:
        """Messages whose id or root id is ``root_id`` that ``agent`` sent or received,
        with a sequence after ``after_seq``, oldest first."""
        raise NotImplementedError

    def expire(self, cutoff: float, now: float, batch: int
               ) -> Tuple[int, int, List[Message], List[Message]]:
        """Remove up to ``batch`` messages stored before ``cutoff`` or whose TTL ran out
        by ``now`` — but a message whose TTL ran out and that
        :func:`relay.rules.delivery.outlives_ttl` is not removed: while queued or leased it is
        returned (its copy: the caller keeps it as expired), and once done, failed or
        expired it is left as it is. Returns ``(removed, counted, unprocessed,
        kept)``: how many were removed, how many of those were not expired already,
        the removed requests that were still queued or leased, and the returned
        messages (``removed`` and ``kept`` together at most ``batch``)."""
        raise NotImplementedError

    def depths(self, now: float, settled: Optional[Sequence[str]] = None
               ) -> List[QueueDepth]:
        """A :class:`QueueDepth` per agent with messages queued, leased, delayed
        (queued with ``not_before`` after ``now``) or failed, sorted by agent; from
        indexes or counters, never a scan of every message. With ``settled``, one
        for each of those agents, counting their done and expired messages too
        (which may read them)."""
        raise NotImplementedError

    def register(self, agent: str, now: float, card: Any) -> None:
        """A heartbeat; ``card`` is the new card, None to remove it, or
        :data:`relay.wire.protocol.KEEP_CARD`."""
        raise NotImplementedError

    def is_registered(self, agent: str) -> bool:
        raise NotImplementedError

    def peers(self) -> List[Tuple[str, int, Optional[Dict[str, Any]]]]:
        """``[(agent, last_seen, card or None)]`` sorted by name."""
        raise NotImplementedError

    # -- events (REACH §11) -------------------------------------------------------------

    def append_event(self, agent: str, event_type: str, data: str, at: float) -> None:
        """Record an event of ``agent``'s stream in the operation's transaction, under
        the next event id (increasing in each agent's stream)."""
        raise NotImplementedError

    def events_after(self, agent: str, after: int, limit: int) -> List[Event]:
        """Up to ``limit`` events of ``agent`` with an id above ``after``, in order."""
        raise NotImplementedError

    def event_marks(self, agent: str = "") -> Tuple[int, int]:
        """``(floor, last)``: the highest event id removed by retention (0: none) and
        the highest ever given (0: none; a store several brokers write may answer
        the newest committed id of ``agent``'s stream)."""
        raise NotImplementedError

    def trim_events(self, cutoff: float) -> int:
        """Remove the events recorded before ``cutoff`` (raising the floor), except
        each agent's newest among them, kept to answer :meth:`kept_after`; returns
        how many."""
        raise NotImplementedError

    def kept_after(self, agent: str, floor: int) -> int:
        """The lowest position after which every event of ``agent`` up to ``floor``
        is still kept: the newest of its events retention reached (kept for this),
        or ``floor`` itself where the store cannot tell (events it removed before it
        kept those)."""
        raise NotImplementedError

    # -- webhooks (REACH §12) -----------------------------------------------------------

    def webhook_states(self) -> Dict[str, str]:
        """Every agent's webhook state (JSON text: :mod:`relay.rules.hooks`), by agent."""
        raise NotImplementedError

    def webhook_state(self, agent: str) -> Optional[str]:
        """``agent``'s webhook state, held for this operation (a store several brokers
        write locks the row until the operation ends)."""
        raise NotImplementedError

    def put_webhook(self, agent: str, state: Optional[str]) -> None:
        """Keep ``agent``'s webhook state (None: it has no webhook)."""
        raise NotImplementedError


# -- the operations, once for every backend -------------------------------------------


def members(records: Records, rules: Optional[Rules], address: str) -> List[str]:
    """The members of the role at ``address`` (``role:NAME``): those of the config, and
    for a ``selfJoin`` role the agents whose card lists it; none for a role no longer
    configured."""
    role = rules.roles.get(address[len(delivery.ROLE_PREFIX):]) if rules is not None else None
    if role is None:
        return []
    found = set(role.members)
    if role.self_join:
        found.update(records.joiners(address[len(delivery.ROLE_PREFIX):]))
    return sorted(found)


def queues(records: Records, agent: str, rules: Rules, role: Optional[str] = None) -> List[str]:
    """The queues ``agent``'s pull leases from (REACH §13): its own and those of the
    roles it holds, by config or by its card; with ``role``, that role's alone (404
    ``no_such_agent`` when it is not configured, 403 ``forbidden`` when ``agent`` does
    not hold it)."""
    roles = rules.roles
    if not roles:
        if role is not None:
            raise errors.no_such_agent(f"no role {role!r} is configured")
        return [agent]
    held = {name for name, r in roles.items() if agent in r.members}
    if any(r.self_join for r in roles.values()):
        card = records.card(agent) or {}
        held.update(name for name in card.get("roles", ())
                    if name in roles and roles[name].self_join)
    if role is not None:
        if role not in roles:
            raise errors.no_such_agent(f"no role {role!r} is configured")
        if role not in held:
            raise errors.forbidden(f"agent {agent!r} does not hold the role {role!r}")
        return [delivery.ROLE_PREFIX + role]
    return [agent] + [delivery.ROLE_PREFIX + name for name in sorted(held)]


def note(records: Records, before: Optional[Tuple[Any, ...]], message: Message,
         now: float, rules: Optional[Rules] = None) -> None:
    """What a change of ``message`` means: the wake-ups, and the events it causes,
    recorded in the same transaction. An event of a role's queue is recorded for
    each member of the role (by ``rules``)."""
    delivery.wakes(records.changes, before, message)
    for agent, event_type, data in events.derive(before, message, now):
        told = members(records, rules, agent) if delivery.is_role(agent) else (agent,)
        for member in told:
            records.append_event(member, event_type, data, now)
            records.changes.events.add(member)


def _saved(records: Records, befores: List[Tuple[Any, ...]], messages: List[Message],
           now: float, rules: Optional[Rules] = None) -> None:
    records.save(messages, befores)
    for before, message in zip(befores, messages):
        note(records, before, message, now, rules)


def _store_notices(records: Records, notices: Iterable[Message], now: float,
                   rules: Optional[Rules] = None) -> None:
    for notice in notices:
        if records.insert(notice):  # an existing id: that request's notice is stored
            note(records, None, notice, now, rules)


def release_lapsed(records: Records, now: float, rules: Rules) -> int:
    """Release every lease past its deadline, so reads report it truthfully."""
    lapsed = records.lapsed(now)
    if not lapsed:
        return 0
    befores = [m.state() for m in lapsed]
    notices: List[Message] = []
    for message in lapsed:
        notices.extend(delivery.catch_up(message, now, rules))
    _saved(records, befores, lapsed, now, rules)
    _store_notices(records, notices, now, rules)
    records.changes.lapsed += len(lapsed)
    return len(lapsed)


def release_due(records: Records, now: float, rules: Optional[Rules] = None,
                limit: int = EXPIRE_BATCH) -> int:
    """Clear the ``not_before`` of queued messages whose delay ended by ``now``: the
    change that records their ``message`` event (REACH §11: deliverable after a
    delay). Returns how many."""
    held = records.held_due(now, limit)
    if not held:
        return 0
    befores = [m.state() for m in held]
    for message in held:
        message.not_before = None
    _saved(records, befores, held, now, rules)
    return len(held)


def _refuse_if_full(records: Records, message: Message, rules: Rules) -> None:
    """429 ``inbox_full`` when ``message`` (a new id) would overfill its recipient's inbox."""
    usage = records.usage(message.to)
    if delivery.inbox_full(usage, message, rules) and not records.seq_of(message.id):
        count, size = usage
        raise errors.inbox_full(
            f"the inbox of {message.to!r} is full ({count} messages, {size} bytes waiting; "
            f"at most {rules.inbox_max_messages} and {rules.inbox_max_bytes}): "
            "try again once it has taken some")


def add(records: Records, message: Message, rules: Rules,
        registered_recipient: bool = False) -> bool:
    """Store a new message unless its recipient never registered while
    ``registered_recipient`` asks it to have (404 ``no_such_agent``) or its inbox is
    full (429 ``inbox_full``); a duplicate id is answered as a duplicate, full inbox
    or not."""
    if registered_recipient and not records.is_registered(message.to):
        raise errors.no_such_agent(f"recipient {message.to!r} has never registered")
    _refuse_if_full(records, message, rules)
    if not records.insert(message):
        return False
    note(records, None, message, message.created, rules)
    return True


def add_group(records: Records, copies: Sequence[Message], sender: str, sent_id: str,
              rules: Rules) -> Tuple[bool, List[Message]]:
    """Store every copy of a group send or none (REACH §13): fires with ``(True,
    copies)``, or ``(False, the copies stored before)`` when ``sender`` sent ``sent_id``
    already. 429 ``inbox_full`` when one member's inbox is full, 409 ``id_conflict``
    when the sent id is a message's or a copy's id is taken; then nothing is
    written."""
    stored = [m for m in records.copies(sent_id) if m.sender == sender]
    if stored:
        return False, sorted(stored, key=lambda m: m.to)
    if records.seq_of(sent_id):
        raise delivery.IdConflict(sent_id, "id")
    for copy in copies:
        if records.seq_of(copy.id):
            taken = records.get(copy.id)
            if taken is not None and (taken.sent_id, taken.sender) == (sent_id, sender):
                raise Raced(copy.id)  # the same send, stored by another writer since
            raise delivery.IdConflict(copy.id, "id")
        _refuse_if_full(records, copy, rules)
    for copy in copies:
        if not records.insert(copy):
            raise Raced(copy.id)  # another writer stored it since the check
        note(records, None, copy, copy.created)
    return True, list(copies)


def find(records: Records, message_id: str, now: float,
         expired: bool = False) -> Optional[Message]:
    message = records.get(message_id)
    if message is None or (delivery.expired(message, now)
                           and not (expired and delivery.outlives_ttl(message))):
        return None
    return message


def poll(records: Records, agent: str, since_id: Optional[str], limit: int, now: float,
         rules: Rules) -> Tuple[List[Message], Optional[str]]:
    release_lapsed(records, now, rules)
    since_seq = records.seq_of(since_id) if since_id else 0
    recovered = records.recovered(agent, since_seq, limit, now) if since_seq else []
    room = limit - len(recovered)
    fresh = records.queued(agent, since_seq, room, now) if room > 0 else []
    states = {m.seq: m.state() for m in recovered + fresh}
    messages, cursor, unmarked = delivery.poll_page(recovered, fresh, limit, since_id,
                                                    RESPONSE_BUDGET_BYTES)
    if unmarked:
        records.save(unmarked, [states[m.seq] for m in unmarked])
    return messages, cursor


def pull(records: Records, agent: str, limit: int, lease_seconds: float, now: float,
         rules: Rules, parent_id: Optional[str] = None,
         role: Optional[str] = None) -> List[Message]:
    """Lease from ``agent``'s queues (:func:`queues`) in the order of
    :func:`relay.rules.delivery.rank`."""
    release_lapsed(records, now, rules)
    found = queues(records, agent, rules, role)
    messages = _budgeted(records.ranked(found, limit, now, parent_id))
    if messages:
        befores = [m.state() for m in messages]
        for message in messages:
            delivery.lease(message, lease_seconds, now, agent)
        _saved(records, befores, messages, now, rules)
    return messages


def settle(records: Records, message_id: str,
           transition: Union[Transition, WithStored], now: float, rules: Rules) -> Any:
    """One transition of one message, with what it stores, in one operation; a
    :class:`~relay.rules.delivery.WithStored` transition sees its second message as read in
    the same operation; a :class:`~relay.rules.delivery.Kept` transition applies also to a
    message kept past its TTL."""
    kept = isinstance(transition, delivery.Kept)
    if kept:
        transition = transition.transition
    message = find(records, message_id, now, kept)
    if message is None:
        raise errors.no_such_message()
    before = message.state()
    notices = list(delivery.catch_up(message, now, rules))
    seen: Optional[Message] = None
    try:
        if isinstance(transition, WithStored):
            seen = find(records, transition.other_id, now)
            outcome = transition.decide(message, seen, now)
        else:
            outcome = transition(message, now)
    except errors.RelayError:
        if message.state() != before:
            _saved(records, [before], [message], now, rules)
        _store_notices(records, notices, now, rules)
        raise
    reply = outcome.reply
    if reply is not None:
        _refuse_if_full(records, reply, rules)
        if not records.insert(reply):  # nothing was written
            if (isinstance(transition, WithStored) and seen is None
                    and transition.other_id == reply.id):
                raise Raced(reply.id)  # decided on a read another writer overtook
            raise delivery.IdConflict(reply.id)
        note(records, None, reply, now, rules)
    if message.state() != before:
        _saved(records, [before], [message], now, rules)
    _store_notices(records, notices + list(outcome.notices), now, rules)
    return outcome.value


def status(records: Records, message_ids: Iterable[str], agent: str, now: float,
           rules: Rules) -> List[Dict[str, Any]]:
    release_lapsed(records, now, rules)
    out = []
    for message_id in message_ids:
        message = find(records, message_id, now)
        if message is not None and agent in (message.sender, message.to, message.holder):
            out.append(message.status_entry(now))
            continue
        copies = [m for m in records.copies(message_id)
                  if m.sender == agent and not delivery.expired(m, now)]
        if copies:
            out.append(delivery.group_status(message_id, copies))
        else:
            out.append(delivery.not_found_status(message_id))
    return out


def _budgeted(messages: List[Message]) -> List[Message]:
    return delivery.within_budget(messages, RESPONSE_BUDGET_BYTES)


def recent(records: Records, agent: str, limit: int, now: float, rules: Rules) -> List[Message]:
    release_lapsed(records, now, rules)
    return _budgeted(records.listing(agent, "inbox", limit, {}, now))


def query(records: Records, agent: str, limit: int, filters: Mapping[str, Optional[str]],
          now: float, rules: Rules, match: Optional[Match] = None) -> List[Message]:
    release_lapsed(records, now, rules)
    box = filters.get("box") or "inbox"
    recipient, sender = filters.get("to"), filters.get("from")
    if box == "inbox" and recipient is not None and recipient != agent:
        return []  # the inbox holds only messages to ``agent``
    if box == "sent" and sender is not None and sender != agent:
        return []
    if match is None:
        return _budgeted(records.listing(agent, box, limit, filters, now))
    return _budgeted(records.listing(agent, box, limit, filters, now, match))


def thread(records: Records, agent: str, root_id: str, since_id: Optional[str], limit: int,
           now: float, rules: Rules) -> Tuple[List[Message], Optional[str]]:
    release_lapsed(records, now, rules)
    since_seq = records.seq_of(since_id) if since_id else 0
    messages = _budgeted(records.thread(agent, root_id, since_seq, limit, now))
    if messages:
        return messages, messages[-1].id
    if since_seq and records.thread(agent, root_id, 0, 1, now):
        return [], since_id  # nothing new in a thread the caller has read
    return [], None


def register(records: Records, agent: str, now: float, card: Any, max_agents: int) -> None:
    """A heartbeat; a new agent beyond ``max_agents`` registered ones (0: no limit) is
    ``403 forbidden``."""
    if (max_agents and not records.is_registered(agent)
            and records.agent_count() >= max_agents):
        raise errors.forbidden(f"this broker serves at most {max_agents} agents "
                               "(broker.maxAgents)")
    records.register(agent, now, card)


def forget(records: Records, cutoff: float) -> List[str]:
    return records.forget(cutoff)


def peers(records: Records) -> List[Tuple[str, int, Optional[Dict[str, Any]]]]:
    return records.peers()


def expire(records: Records, cutoff: float, now: float, rules: Rules,
           batch: int) -> Tuple[int, int]:
    """One batch of the expiry sweep: ``(messages removed or kept as expired, of which
    expired now)``; the failure notices of the requests that expired unprocessed."""
    removed, counted, unprocessed, kept = records.expire(cutoff, now, batch)
    notices = delivery.expiry_notices(unprocessed + kept, now, rules)
    if kept:
        befores = [m.state() for m in kept]
        for message in kept:
            delivery.keep_expired(message)
        records.save(kept, befores)
    _store_notices(records, notices, now, rules)
    return removed + len(kept), counted + len(kept)


def read_events(records: Records, agent: str, position: Optional[int],
                limit: int) -> EventPage:
    """The events of ``agent`` after ``position`` (:func:`relay.rules.events.parse_event_id`;
    None: none, the stream starts at the present), or a reset when the store cannot
    resume from there."""
    floor, last = records.event_marks(agent)
    if position is not None and 0 <= position < floor:
        # Retention removed events up to the floor, of every agent: this agent's
        # stream resumes unless some of its own were among them.
        floor = records.kept_after(agent, floor)
    reason = events.resume(position, floor, last)
    if position is None or reason is not None:
        return EventPage([], reason, last)
    found = records.events_after(agent, position, limit)
    return EventPage(found, None, found[-1].id if found else position)


def trim_events(records: Records, cutoff: float) -> int:
    return records.trim_events(cutoff)


def webhook_states(records: Records) -> Dict[str, str]:
    return {agent: state for agent, state in records.webhook_states().items()
            if agent != WEBHOOK_LEADER}


def put_webhook(records: Records, agent: str, state: Optional[str]) -> None:
    records.put_webhook(agent, state)
    records.changes.hooks.add(agent)


def merge_webhook(records: Records, agent: str, fields: Mapping[str, Any],
                  defaults: Optional[Mapping[str, Any]] = None, announce: bool = True) -> str:
    """Set ``fields`` of ``agent``'s webhook state, and ``defaults`` where it has no
    value yet (read and written in one operation, so what another broker set
    in between is kept); with ``announce``, the brokers hear of it. Returns the
    state written."""
    text = records.webhook_state(agent)
    state = json.loads(text) if text else {}
    for key, value in (defaults or {}).items():
        state.setdefault(key, value)
    state.update(fields)
    merged = json.dumps(state, separators=(",", ":"), sort_keys=True)
    records.put_webhook(agent, merged)
    if announce:
        records.changes.hooks.add(agent)
    return merged


def lead_webhooks(records: Records, owner: str, now: float, hold: float) -> bool:
    """Make ``owner`` the broker that delivers every webhook until ``now + hold``
    unless another broker holds that role for longer; True when ``owner`` has it."""
    text = records.webhook_state(WEBHOOK_LEADER)
    lead = json.loads(text) if text else {}
    if lead.get("owner") not in (None, owner) and lead.get("until", 0) > now:
        return False
    records.put_webhook(WEBHOOK_LEADER, json.dumps({"owner": owner, "until": now + hold}))
    return True


def depths(records: Records, now: float,
           settled: Optional[Sequence[str]] = None) -> List[QueueDepth]:
    if settled is None:
        return records.depths(now)
    return records.depths(now, sorted(set(settled)))


# -- the store ---------------------------------------------------------------------------


@implementer(IMessageStore)
class RecordStore:
    """An IMessageStore over :class:`Records`.

    Without ``commits`` every operation's Deferred fires at once; with a
    :class:`GroupCommit` results wait for the commit that makes them durable.
    Changes are reported to the subscribers after the commit that holds them.
    """

    name = "records"

    def __init__(self, records: Records, commits: Optional[GroupCommit] = None) -> None:
        self.records = records
        self.commits = commits
        self._listeners: List[Listener] = []
        if commits is not None:
            commits.on_commit = self._report

    def _run(self, operation: Callable[..., Any], *args: Any) -> Deferred:
        if self.commits is not None:
            return self.commits.run(operation, self.records, *args)
        try:
            d = succeed(operation(self.records, *args))
        except Exception:
            d = fail()
        self._report()
        return d

    def _report(self) -> None:
        changes = self.records.changes
        if changes:
            self.records.changes = Changes()
            for listener in self._listeners:
                listener(changes)

    # -- IMessageStore -----------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def add(self, message: Message, rules: Rules,
            registered_recipient: bool = False) -> Deferred:
        return self._run(add, message, rules, registered_recipient)

    def add_group(self, copies: Sequence[Message], sender: str, sent_id: str,
                  rules: Rules) -> Deferred:
        return self._run(add_group, copies, sender, sent_id, rules)

    def find(self, message_id: str, now: float, expired: bool = False) -> Deferred:
        return self._run(find, message_id, now, expired)

    def poll(self, agent: str, since_id: Optional[str], limit: int, now: float,
             rules: Rules) -> Deferred:
        return self._run(poll, agent, since_id, limit, now, rules)

    def pull(self, agent: str, limit: int, lease_seconds: float, now: float, rules: Rules,
             parent_id: Optional[str] = None, role: Optional[str] = None) -> Deferred:
        return self._run(pull, agent, limit, lease_seconds, now, rules, parent_id, role)

    def settle(self, message_id: str, transition: Union[Transition, WithStored], now: float,
               rules: Rules) -> Deferred:
        return self._run(settle, message_id, transition, now, rules)

    def status(self, message_ids: Sequence[str], agent: str, now: float,
               rules: Rules) -> Deferred:
        return self._run(status, message_ids, agent, now, rules)

    def recent(self, agent: str, limit: int, now: float, rules: Rules) -> Deferred:
        return self._run(recent, agent, limit, now, rules)

    def query(self, agent: str, limit: int, filters: Mapping[str, Optional[str]], now: float,
              rules: Rules, match: Optional[Match] = None) -> Deferred:
        return self._run(query, agent, limit, filters, now, rules, match)

    def thread(self, agent: str, root_id: str, since_id: Optional[str], limit: int,
               now: float, rules: Rules) -> Deferred:
        return self._run(thread, agent, root_id, since_id, limit, now, rules)

    def register(self, agent: str, now: float, card: Any = KEEP_CARD,
                 max_agents: int = 0) -> Deferred:
        return self._run(register, agent, now, card, max_agents)

    def forget_peers(self, cutoff: float) -> Deferred:
        return self._run(forget, cutoff)

    def space_left(self) -> Optional[int]:
        """None: a store in memory has no disk to fill."""
        return None

    def is_registered(self, agent: str) -> Deferred:
        """Answered at once: the records know their agents before the commit."""
        return succeed(self.records.is_registered(agent))

    def peers(self) -> Deferred:
        return self._run(peers)

    def sweep_leases(self, now: float, rules: Rules) -> Deferred:
        return self._run(release_lapsed, now, rules)

    def release_due(self, now: float, rules: Optional[Rules] = None) -> Deferred:
        return self._run(release_due, now, rules)

    @inlineCallbacks
    def sweep_expired(self, cutoff: float, now: float, rules: Rules):
        """Removes in batches, one per run, so a large expiry never stalls requests."""
        total = 0
        while True:
            touched, counted = yield self._run(expire, cutoff, now, rules, EXPIRE_BATCH)
            total += counted
            if touched < EXPIRE_BATCH:
                return total

    def queue_depths(self, now: float, settled: Optional[Sequence[str]] = None) -> Deferred:
        return self._run(depths, now, settled)

    def events(self, agent: str, position: Optional[int], limit: int) -> Deferred:
        return self._run(read_events, agent, position, limit)

    def trim_events(self, cutoff: float) -> Deferred:
        return self._run(trim_events, cutoff)

    def webhook_states(self) -> Deferred:
        return self._run(webhook_states)

    def put_webhook(self, agent: str, state: Optional[str]) -> Deferred:
        return self._run(put_webhook, agent, state)

    def merge_webhook(self, agent: str, fields: Mapping[str, Any],
                      defaults: Optional[Mapping[str, Any]] = None,
                      announce: bool = True) -> Deferred:
        return self._run(merge_webhook, agent, fields, defaults, announce)

    def lead_webhooks(self, owner: str, now: float, hold: float) -> Deferred:
        """True at once: one broker writes these stores, so it delivers the webhooks
        (also right after a restart that left the role of its former process)."""
        return succeed(True)

    def health(self) -> Deferred:
        return succeed(self.commits.failure if self.commits is not None else None)

    def observe_commits(self, listener: Callable[[float], None]) -> None:
        if self.commits is not None:
            self.commits.observers.append(listener)

    def close(self) -> Deferred:
        if self.commits is not None:
            self.commits.close()
        return succeed(None)

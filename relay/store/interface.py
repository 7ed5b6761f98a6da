"""The storage contract every backend implements, and the plugin that opens one.

Backends are found with :func:`twisted.plugin.getPlugins` as
:class:`IStoreFactory` plugins (see ``twisted/plugins/relay_stores.py``); the
broker opens the one whose ``name`` equals ``broker.storage``.

Each :class:`IMessageStore` method has one return shape: every one that reads
or writes records returns a Deferred, also in memory, so a networked backend
fits the same contract (``space_left`` answers at once; ``subscribe``,
``observe_commits`` register a listener). The
delivery rules themselves (spec §5.1) are the transitions of
:mod:`relay.rules.delivery`; a store keeps the records and indexes, applies the
transitions it is handed, and reports what its committed changes mean for
waiting requests (:class:`relay.rules.delivery.Changes`) to its subscribers.
Messages a store returns are copies: changing them changes nothing stored.
Times are epoch seconds (floats) from the broker's clock.

:mod:`relay.store.records` implements this contract once over a small set of
synchronous, indexed primitives; the built-in backends are such primitives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zope.interface import Attribute, Interface

from relay.wire.protocol import KEEP_CARD


@dataclass(frozen=True)
class QueueDepth:
    """One recipient's backlog (:meth:`IMessageStore.queue_depths`): messages by
    state (``queued`` without the ``delayed`` ones), and when its oldest queued
    message that is not delayed was stored (epoch seconds; None when there is
    none); ``done`` and ``expired`` only when asked for (``settled``)."""

    agent: str
    queued: int = 0
    leased: int = 0
    failed: int = 0
    delayed: int = 0
    oldest_queued: Optional[float] = None
    done: int = 0
    expired: int = 0


class IMessageStore(Interface):
    """Stored messages, their delivery state, and the registry of peers."""

    name = Attribute("The backend's name, as reported by GET / in ``storage``.")

    def subscribe(listener):
        """Call ``listener(changes)`` with the :class:`relay.rules.delivery.Changes` of
        every change once it is durable: this store's own, and, for a store shared
        by several brokers, those another broker made."""

    def add(message, rules, registered_recipient=False):
        """Store a new message (a :class:`relay.rules.delivery.Message` without a seq).

        The store assigns the next sequence number. Fires with True when stored,
        False when a message with that id already exists (deduplication); fires
        only once the message is durable. With ``registered_recipient``, errbacks
        404 ``no_such_agent`` first when ``message.to`` never registered (spec §2),
        decided in the same operation. Errbacks 429 ``inbox_full`` when the
        recipient's pending (queued or leased) messages would exceed a limit of
        ``rules`` (:func:`relay.rules.delivery.inbox_full`), counted exactly (also
        across brokers sharing the store) from counters, never by a scan.
        """

    def add_group(copies, sender, sent_id, rules):
        """Store the copies of a group send (REACH §13; :func:`relay.rules.delivery.group_copies`)
        in one transaction, all or none. Fires with ``(True, copies)`` once durable,
        or ``(False, the copies stored before)`` when ``sender`` sent ``sent_id``
        already (the same on every broker sharing the store). Errbacks 429
        ``inbox_full`` when one copy would overfill its member's inbox, 409
        ``id_conflict`` when ``sent_id`` is a message's id or a copy's id is
        taken; nothing is written then. Members need not have registered."""

    def find(message_id, now, expired=False):
        """Fires with (a copy of) the message of that id, or None (also when its
        ``ttlSeconds`` ran out by ``now``; with ``expired``, a message the store keeps
        past its TTL, :func:`relay.rules.delivery.outlives_ttl`, is found still)."""

    def poll(agent, since_id, limit, now, rules):
        """v1.0 poll: fires with ``(messages, cursor)``.

        Lapsed leases are released first. The page is
        :func:`relay.rules.delivery.poll_page` of the queued messages to ``agent``:
        the recovery deliveries at or before ``since_id``'s sequence, then
        those after it (all when None or unknown); at most ``limit``.
        """

    def pull(agent, limit, lease_seconds, now, rules, parent_id=None, role=None):
        """Lease up to ``limit`` deliverable messages to ``agent`` from its own queue
        and the queues of the roles it holds (REACH §13: by ``rules.roles``, and for
        a ``selfJoin`` role by its card's ``roles``), higher priority first, then
        oldest first (:func:`relay.rules.delivery.rank`, REACH §14); with ``parent_id``:
        only those whose ``parent_id`` or ``reply_to`` is it; with ``role``: from
        that role's queue alone (404 ``no_such_agent`` for a role not configured,
        403 ``forbidden`` for one ``agent`` does not hold). A role message leased
        records ``agent`` as its ``holder``.

        A lease past its deadline is released first, so its message can be
        leased again. Fires with the leased messages, each with a fresh
        ``lease_id`` and ``lease_until`` and one more delivery.
        """

    def settle(message_id, transition, now, rules):
        """Apply :func:`relay.rules.delivery.catch_up`, then ``transition(message, now)`` (a
        :mod:`relay.rules.delivery` transition) to the message of that id, in one
        transaction: its changes, the failure notices of its
        :class:`~relay.rules.delivery.Outcome` (one per request: an existing notice id is
        not stored again) and its reply. A :class:`relay.rules.delivery.WithStored`
        transition is applied as ``decide(message, other, now)``, ``other`` the
        message ``other_id`` as read in the same transaction (None when unknown or
        expired): an ack with a reply, its duplicate rule included, and a v1.0
        receipt are each one settle. A :class:`relay.rules.delivery.Kept` transition
        applies also to a message kept past its TTL. What ``catch_up`` changed is
        kept also when the transition raises. Fires with the outcome's value.

        Errbacks with :class:`relay.wire.errors.RelayError`: 404 ``no_such_message``
        for an unknown or expired id, :class:`relay.rules.delivery.IdConflict` when the
        reply's id exists, 429 ``inbox_full`` when the reply would overfill its
        recipient's inbox (in both cases nothing is written), or whatever the
        transition raised.
        """

    def status(message_ids, agent, now, rules):
        """Fires with one :meth:`~relay.rules.delivery.Message.status_entry` per id; for the
        id of a group send of ``agent``, :func:`relay.rules.delivery.group_status` of its
        copies; ``not_found`` for ids ``agent`` neither sent, received nor held the
        lease of (a role message)."""

    def recent(agent, limit, now, rules):
        """Fires with the newest ``limit`` messages to ``agent``, any status."""

    def query(agent, limit, filters, now, rules, match=None):
        """Fires with the newest ``limit`` messages of ``agent``'s box that match every
        filter of ``filters``: ``box`` (``inbox``, the default — the messages
        addressed to ``agent``, as the reference broker searches —, ``sent`` or
        ``all``), and ``kind``, ``status``, ``from``, ``to``, ``rootId`` (id or root
        id), ``parentId`` (parent id or reply-to), each a value or None.

        With ``match`` (a predicate on a message), the newest ``limit`` of those for
        which ``match`` is also true, however many others the store reads on the
        way (a filter the store has no index for: the v2/v3 wire's); messages past
        their TTL are handed to ``match`` too, which decides about them."""

    def thread(agent, root_id, since_id, limit, now, rules):
        """Fires with ``(messages, cursor)``: the messages whose id or root id is
        ``root_id`` that ``agent`` sent or received, oldest first, after
        ``since_id`` (from the start when None or unknown); ``cursor`` as for
        :meth:`poll`, None for an unknown root."""

    def register(agent, now, card=KEEP_CARD, max_agents=0):
        """Record a heartbeat of ``agent`` at ``now`` with its peer card (a dict; None
        removes it; :data:`relay.wire.protocol.KEEP_CARD` keeps the stored one); fires
        with None. Errbacks 403 ``forbidden`` for a new agent when ``max_agents``
        (0: no limit) are registered already."""

    def forget_peers(cutoff):
        """Forget the agents last seen before ``cutoff`` that no stored message is
        addressed to (a message kept as expired does not count; they may register
        again); fires with their names."""

    def space_left():
        """The bytes free where the store writes (an int, at once), or None when the
        broker cannot tell (a store in memory, a database server's disk)."""

    def is_registered(agent):
        """Fires with True when ``agent`` has ever registered (and not been forgotten).
        A send does not ask it: :meth:`add` checks its recipient itself."""

    def peers():
        """Fires with ``[(agent, last_seen_seconds, card or None)]`` sorted by name."""

    def sweep_leases(now, rules):
        """Release every lease past its deadline; fires with how many."""

    def sweep_expired(cutoff, now, rules):
        """Remove every message stored before ``cutoff`` or whose ``ttlSeconds`` ran
        out by ``now``, storing the failure notices of requests that expired
        unprocessed; fires with how many expired. A message of the v2/v3 wire whose
        TTL ran out is kept until ``cutoff`` passes it
        (:func:`relay.rules.delivery.outlives_ttl`): one still queued or leased becomes
        ``expired`` (:func:`relay.rules.delivery.keep_expired`, counted then), one done or
        failed stays so."""

    def queue_depths(now, settled=None):
        """Fires with a :class:`QueueDepth` per agent that has messages queued,
        leased, delayed (queued and held back past ``now``) or failed, sorted by
        agent; ``queued`` does not count the delayed ones. Answered from indexes
        or counters the store keeps, never by reading every message (metrics ask
        for it at each scrape). Leases are counted as stored: one past its
        deadline counts as leased until a sweep or a read releases it.

        With ``settled`` (agent names), the depths of those agents alone, one each
        (its ``oldest_queued`` and counts 0 when it has no message), counting also
        its ``done`` and ``expired`` messages: the roster of a signed v2
        ``/healthz``, which may read those agents' messages, not the metrics."""

    def health():
        """Fires with None while the store accepts writes, else a short reason
        (no message content), such as the error of a commit that keeps failing."""

    def observe_commits(listener):
        """Call ``listener(seconds)`` with the duration of every commit the store
        makes (a store that commits nothing never calls it)."""

    def close():
        """Flush and release the backend; fires when done."""


class ISharedLockouts(Interface):
    """A store shared by several brokers that keeps their lockout counters too, so
    N brokers do not give an attacker N times the attempts (spec §3 lockout)."""

    def share_lockouts(lockout):
        """Count the failures of ``lockout`` (a :class:`relay.rules.auth.Lockout`) for every
        broker, by its rules, and apply to it the locks other brokers decide and the
        unlocks operators make; returns the object ``lockout`` reports to
        (:class:`relay.rules.auth.SharedLockouts`). Its ``failed`` fires once the failure
        is counted and a lock it caused applied to ``lockout``: the HTTP layer
        answers the refusal after that."""


class ISharedNonces(Interface):
    """A store shared by several brokers that keeps the signed nonces they accepted
    too (EXTENSIONS.md §9), so the fleet accepts each ``(agent, nonce)`` once within
    the skew window, as one broker does, rather than once per broker."""

    def claim_nonce(agent, nonce, timestamp, address=None):
        """Record that ``agent`` used ``nonce`` in a request signed at ``timestamp``
        (epoch seconds, an int); fires with True when no broker sharing the store
        used it within the skew window, False when one did. Errbacks 503 ``busy``
        when the store cannot tell (a request is never accepted unchecked). Seen
        nonces are forgotten once the window is over, by :meth:`IMessageStore.sweep_expired`
        at the latest: the table stays bounded. A store that shares lockouts too
        (:class:`ISharedLockouts`) applies a lock of ``agent`` in force for
        ``address`` (a client address group) to the shared lockout before firing,
        so a lock any broker set holds here at once."""


class IStoreFactory(Interface):
    """A plugin that opens one kind of store."""

    name = Attribute("The value of ``broker.storage`` that selects this backend.")

    def parse_options(section, config):
        """Validate this backend's own config section ``broker.<name>`` (a mapping;
        ``{}`` when the file has none) against the broker's
        :class:`relay.rules.config.Config`; returns the options :meth:`open` takes.

        Raises :class:`relay.wire.errors.ConfigError` naming ``broker.<name>.<key>``.
        The built-in backends describe their keys as :class:`relay.rules.config.Setting`
        rows and read them with :func:`relay.rules.config.read_settings`; a plugin may too.
        """

    def open(config, options, reactor):
        """Open a store with the :meth:`parse_options` result; returns an IMessageStore.

        ``reactor`` is the store's only source of time and threads: it provides
        ``IReactorTime`` (group commits, timers, background work) and, in a running
        broker, ``IReactorThreads``. A backend that can do its background work
        inline does so when ``reactor`` has no threads (a
        :class:`twisted.internet.task.Clock` in tests); one that cannot raises
        TypeError. No store imports the global reactor.

        Raises :class:`relay.wire.errors.ConfigError` (with the path and the reason)
        when the store cannot be opened.
        """

"""The storage contract every backend implements, and the plugin that opens one.

Backends are found with :func:`twisted.plugin.getPlugins` as
:class:`IStoreFactory` plugins (see ``twisted/plugins/relay_stores.py``); the
broker opens the one whose ``name`` equals ``broker.storage``.

Every :class:`IMessageStore` method returns a Deferred, also in memory, so a
networked backend fits the same contract. The delivery rules themselves (spec
§5.1) live in :mod:`relay.delivery`; stores keep the records and indexes.
Times are epoch seconds (floats) from the broker's clock.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface


class IMessageStore(Interface):
    """Stored messages, their delivery state, and the registry of peers."""

    name = Attribute("The backend's name, as reported by GET / in ``storage``.")

    def add(message):
        """Store a new message (a :class:`relay.delivery.Message` without a seq).

        The store assigns the next sequence number and ``status: queued``.
        Fires with True when stored, False when a message with that id already
        exists (deduplication); fires only once the message is durable.
        """

    def find(message_id):
        """Fires with the :class:`~relay.delivery.Message` of that id, or None."""

    def get_since(agent, since_id, limit, now):
        """v1.0 poll: fires with ``(messages, cursor)``.

        Queued messages to ``agent`` with a sequence after that of ``since_id``
        (all when None or unknown), preceded by the recovery deliveries (queued
        messages at or before the cursor whose lease expired since); at most
        ``limit`` in all. ``cursor`` is the id of the last message after the
        cursor that was returned, else ``since_id`` (None when empty). Each
        recovery delivery is returned once.
        """

    def pull(agent, limit, lease_seconds, now):
        """Lease up to ``limit`` queued messages to ``agent``, oldest first.

        Expired leases are released first. Fires with the leased messages,
        each with a fresh ``lease_id`` and ``lease_until``.
        """

    def ack(message_id, agent, lease_id, outcome, error, now, max_attempts):
        """Settle a lease (``completed`` or ``retry``); fires with the result dict.

        Errbacks with :class:`relay.errors.RelayError`: 404 ``no_such_message``,
        403 ``forbidden`` (not the recipient), 409 ``not_leased`` or
        ``lease_mismatch``.
        """

    def status(message_ids, agent):
        """Fires with one status dict per id, ``not_found`` for ids ``agent``
        neither sent nor received."""

    def recent(agent, limit):
        """Fires with the newest ``limit`` messages to ``agent``, any status."""

    def query(agent, limit, kind, status, sender, recipient):
        """Fires with the newest ``limit`` messages addressed to ``agent`` that
        match every filter that is not None (a ``recipient`` other than ``agent``
        matches nothing), as the reference broker searches."""

    def register(agent, now):
        """Record a heartbeat of ``agent`` at ``now``; fires with None."""

    def is_registered(agent):
        """True when ``agent`` has ever registered. Answered at once with a bool by the
        built-in stores (they keep the names in memory, and every send asks); a
        Deferred firing with the bool is also accepted, for a store that must ask
        elsewhere."""

    def peers():
        """Fires with ``[(agent, last_seen_seconds)]`` sorted by agent name."""

    def sweep_leases(now):
        """Release every expired lease; fires with the set of agents that got
        messages back."""

    def sweep_expired(cutoff):
        """Remove every message stored before ``cutoff``; fires with how many."""

    def close():
        """Flush and release the backend; fires when done."""


class IStoreFactory(Interface):
    """A plugin that opens one kind of store."""

    name = Attribute("The value of ``broker.storage`` that selects this backend.")

    def open(config, clock):
        """Open a store for a :class:`relay.config.Config`; returns an IMessageStore.

        Raises :class:`relay.config.ConfigError` (with the path and the reason)
        when the store cannot be opened.
        """

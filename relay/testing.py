"""Test support shipped with the package: a configured in-memory API, a signing
test client, and :class:`StoreContract`, the behaviour every storage backend
must show (spec §4, §5.1). A third-party backend proves itself by running the
contract against its own store fixture.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from relay.rules import delivery
from relay.rules.config import Config, parse_config
from relay.rules.delivery import Changes, Message, Rules
from relay.wire import errors
from relay.wire.protocol import DONE, FAILED, LEASED, QUEUED, iso_timestamp
from relay.wire.signing import sign

SECRET = "s3cret-for-the-tests"
START = 1_712_345_678.0


def make_config(base_dir: str = "/tmp", agents: Optional[Dict[str, Any]] = None,
                security: Optional[Dict[str, Any]] = None,
                groups: Optional[Dict[str, Any]] = None, roles: Optional[Dict[str, Any]] = None,
                **broker: Any) -> Config:
    """A validated Config: the shared secret :data:`SECRET`, memory storage, and ``broker``
    (and ``agents``, ``security``, ``groups``, ``roles`` sections when given)."""
    values = {"secret": SECRET, "storage": "memory"}
    values.update(broker)
    data: Dict[str, Any] = {"broker": values}
    if agents is not None:
        data["agents"] = agents
    if security is not None:
        data["security"] = security
    if groups is not None:
        data["groups"] = groups
    if roles is not None:
        data["roles"] = roles
    return parse_config(data, base_dir)


def make_rules(**changes: Any) -> Rules:
    """The delivery rules of a config that sets nothing (the config table's defaults),
    with ``changes``."""
    from relay.broker.operations import Policy

    return replace(Policy.from_config(make_config()).rules, **changes)


def new_message(sender: str, to: str, now: float, ttl_seconds: Optional[int] = None,
                delay_seconds: int = 0, **fields: Any) -> Message:
    """A message as the API would build it from a shorthand envelope."""
    envelope = {
        "id": fields.pop("id", None) or str(uuid.uuid4()),
        "from": sender,
        "to": to,
        "type": "message",
        "body": {"text": "hello"},
        "replyTo": None,
        "ack": False,
        "kind": "message",
        "rootId": None,
        "parentId": None,
    }
    envelope.update(fields)
    return Message.from_envelope(envelope, now, ttl_seconds, delay_seconds)


class SignedClient:
    """Signs requests per spec §3 and sends them to ``site`` in memory
    (:class:`relay.broker.loopback.MemoryHTTP`)."""

    def __init__(self, site, clock: Clock, secret: str = SECRET) -> None:
        from relay.broker.loopback import MemoryHTTP

        self.clock = clock
        self.secret = secret
        self.http = MemoryHTTP(site, clock)

    def headers(self, agent: str, method: str, path: str, raw: bytes,
                secret: Optional[str] = None, timestamp: Optional[int] = None) -> Dict[str, str]:
        ts = int(self.clock.seconds()) if timestamp is None else timestamp
        return {
            "X-Relay-Agent": agent,
            "X-Relay-Timestamp": str(ts),
            "X-Relay-Signature": sign(secret or self.secret, method, path, ts, raw),
            "Content-Type": "application/json",
        }

    async def request(self, agent: Optional[str], method: str, path: str, body: Any = None,
                      raw: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None,
                      **sign_options: Any) -> Tuple[int, Any, Any]:
        """Send one request; returns ``(status, parsed JSON body, response)``."""
        if raw is None:
            raw = b"" if body is None else json.dumps(body).encode("utf-8")
        all_headers = {} if agent is None else self.headers(agent, method, path, raw,
                                                            **sign_options)
        all_headers.update(headers or {})
        response = await self.http.request(
            method, "http://127.0.0.1:19121" + path, data=raw or None, headers=all_headers
        )
        content = await response.content()
        return response.code, json.loads(content) if content else None, response

    async def get(self, agent: Optional[str], path: str, **kw: Any):
        return await self.request(agent, "GET", path, **kw)

    async def post(self, agent: Optional[str], path: str, body: Any = None, **kw: Any):
        return await self.request(agent, "POST", path, body, **kw)


def make_api(clock: Optional[Clock] = None, store=None, config: Optional[Config] = None,
             **broker: Any):
    """``(api, client, clock)``: a broker over a memory store as
    :func:`relay.broker.assembly.assemble` builds it (without listeners), and a signing
    client of its site.

    ``api.broker`` is the :class:`relay.broker.operations.Broker` behind it.
    """
    from relay.broker.assembly import assemble
    from relay.store.memory import MemoryStore

    clock = clock if clock is not None else Clock()
    if clock.seconds() == 0:
        clock.advance(START)
    config = config if config is not None else make_config(**broker)
    built = assemble(config, store if store is not None else MemoryStore(), clock, listen=False)
    return built.api, SignedClient(built.site, clock), clock


RULES = make_rules(max_attempts=3)


async def _error(d) -> errors.RelayError:
    try:
        await d
    except errors.RelayError as e:
        return e
    raise AssertionError("expected a RelayError")


def ack(store, message_id: str, agent: str, lease_id: str, outcome: str,
        error: Optional[str], now: float, rules: Rules = RULES):
    """Settle a lease through the store with :func:`relay.rules.delivery.ack`."""
    return store.settle(message_id, delivery.ack(agent, lease_id, outcome, error, rules), now,
                        rules)


class Recorder:
    """A store subscriber that keeps every :class:`relay.rules.delivery.Changes` it hears."""

    def __init__(self) -> None:
        self.heard: List[Changes] = []
        self.lapsed = 0

    def __call__(self, changes: Changes) -> None:
        self.heard.append(changes)
        self.lapsed += changes.lapsed

    def take(self) -> Tuple[set, set]:
        """``(ready agents, due pairs)`` heard since the last take (lease deadlines
        held included)."""
        ready, due = set(), set()
        for changes in self.heard:
            ready |= changes.ready
            due |= changes.due
            due.update(changes.held)
        self.heard = []
        return ready, due


class _Contract:
    LEASE = 60

    async def send(self, store, sender="alpha", to="beta", now=START, **fields) -> Message:
        message = new_message(sender, to, now, **fields)
        assert await store.add(message, RULES) is True
        return message


class StoreContract(_Contract):
    """Behaviour tests for an IMessageStore; needs a ``store`` fixture.

    Every test drives time explicitly (``now``), never sleeps.
    """

    LEASE = 60

    async def send(self, store, sender="alpha", to="beta", now=START, **fields) -> Message:
        message = new_message(sender, to, now, **fields)
        assert await store.add(message, RULES) is True
        return message

    def test_provides_the_interface(self, store):
        from zope.interface.verify import verifyObject

        from relay.store.interface import IMessageStore

        assert verifyObject(IMessageStore, store)

    # -- add, dedup, find ------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_add_then_find(self, store):
        sent = await self.send(store, body={"text": "hi", "n": [1, 2]}, kind="request",
                               rootId="r1", replyTo="x")
        found = await store.find(sent.id, START)
        assert found.envelope() == {
            "id": sent.id, "from": "alpha", "to": "beta", "ts": sent.ts, "type": "message",
            "body": {"text": "hi", "n": [1, 2]}, "replyTo": "x", "ack": False,
            "kind": "request", "rootId": "r1", "parentId": None, "status": QUEUED,
            "attempts": 0, "leaseUntil": None,
        }
        assert await store.find("nope", START) is None

    @pytest_twisted.ensureDeferred
    async def test_duplicate_id_is_not_stored_twice(self, store):
        sent = await self.send(store, id="same")
        again = new_message("alpha", "beta", START + 1, id="same", body={"text": "other"})
        assert await store.add(again, RULES) is False
        assert (await store.find("same", START)).body == sent.body
        messages, _ = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == ["same"]

    @pytest_twisted.ensureDeferred
    async def test_any_string_is_an_id(self, store):
        for message_id in ("plain", "with space", "sl/ash", "ünï", "x" * 300):
            await self.send(store, id=message_id)
            assert (await store.find(message_id, START)).id == message_id

    @pytest_twisted.ensureDeferred
    async def test_returned_messages_are_copies(self, store):
        sent = await self.send(store, id="m", body={"text": "kept", "list": [1]})
        sent.status, sent.body["text"] = DONE, "changed after add"
        views = [await store.find("m", START), (await store.recent("beta", 1, START, RULES))[0],
                 (await store.query("beta", 1, {}, START, RULES))[0],
                 (await store.poll("beta", None, 1, START, RULES))[0][0]]
        for view in views:
            view.status, view.attempts, view.lease_id = DONE, 9, "forged"
            view.body["text"] = "changed"
            view.body["list"].append(2)
        (leased,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert leased.body == {"text": "kept", "list": [1]} and leased.attempts == 0
        leased.status, leased.lease_id = QUEUED, "forged"
        leased.body["text"] = "changed"
        found = await store.find("m", START)
        assert found.status == LEASED and found.lease_id not in (None, "forged")
        assert found.body == {"text": "kept", "list": [1]}
        assert await store.pull("beta", 1, self.LEASE, START, RULES) == []

    # -- v1.0 poll ---------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_poll_cursor(self, store):
        ids = [(await self.send(store, id=f"m{i}")).id for i in range(5)]
        await self.send(store, to="gamma", id="other")
        messages, cursor = await store.poll("beta", None, 2, START, RULES)
        assert [m.id for m in messages] == ids[:2] and cursor == ids[1]
        messages, cursor = await store.poll("beta", cursor, 50, START, RULES)
        assert [m.id for m in messages] == ids[2:] and cursor == ids[4]
        messages, cursor = await store.poll("beta", cursor, 50, START, RULES)
        assert messages == [] and cursor == ids[4]
        messages, cursor = await store.poll("beta", "unknown", 50, START, RULES)
        assert [m.id for m in messages] == ids
        messages, cursor = await store.poll("nobody", None, 50, START, RULES)
        assert messages == [] and cursor is None

    @pytest_twisted.ensureDeferred
    async def test_poll_returns_only_queued(self, store):
        a = await self.send(store, id="a")
        b = await self.send(store, id="b")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        messages, cursor = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == [b.id] and cursor == b.id
        assert (await store.find(a.id, START)).status == LEASED

    @pytest_twisted.ensureDeferred
    async def test_recovery_delivery_after_lease_expiry(self, store):
        a = await self.send(store, id="a")
        b = await self.send(store, id="b")
        leased = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert [m.id for m in leased] == ["a"]
        messages, cursor = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == ["b"] and cursor == "b"
        assert await store.sweep_leases(START + self.LEASE + 1, RULES) == 1
        messages, cursor2 = await store.poll("beta", cursor, 50, START + self.LEASE + 1, RULES)
        assert [m.id for m in messages] == [a.id]
        assert cursor2 == b.id, "the cursor never moves backwards"
        messages, _ = await store.poll("beta", cursor2, 50, START + self.LEASE + 2, RULES)
        assert messages == [], "a recovery delivery happens once"

    @pytest_twisted.ensureDeferred
    async def test_recovery_without_sweep(self, store):
        await self.send(store, id="a")
        await self.send(store, id="b")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        _, cursor = await store.poll("beta", None, 50, START, RULES)
        messages, _ = await store.poll("beta", cursor, 50, START + self.LEASE + 1, RULES)
        assert [m.id for m in messages] == ["a"]

    @pytest_twisted.ensureDeferred
    async def test_recovery_deliveries_count_against_the_limit(self, store):
        for i in range(3):
            await self.send(store, id=f"r{i}")
        await self.send(store, id="after")
        await store.pull("beta", 3, self.LEASE, START, RULES)
        _, cursor = await store.poll("beta", None, 50, START, RULES)
        later = START + self.LEASE
        messages, cursor = await store.poll("beta", cursor, 2, later, RULES)
        assert [m.id for m in messages] == ["r0", "r1"] and cursor == "after"
        messages, cursor = await store.poll("beta", cursor, 2, later, RULES)
        assert [m.id for m in messages] == ["r2"] and cursor == "after"

    # -- pull and settle --------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_pull_leases_oldest_first(self, store):
        ids = [(await self.send(store, id=f"m{i}")).id for i in range(3)]
        await self.send(store, to="gamma")
        leased = await store.pull("beta", 2, self.LEASE, START, RULES)
        assert [m.id for m in leased] == ids[:2]
        for m in leased:
            assert m.status == LEASED and m.lease_id
            assert m.lease_until == int(START * 1000) + self.LEASE * 1000
            assert m.envelope("beta")["leaseId"] == m.lease_id
        assert leased[0].lease_id != leased[1].lease_id
        rest = await store.pull("beta", 10, self.LEASE, START, RULES)
        assert [m.id for m in rest] == ids[2:]
        assert await store.pull("beta", 10, self.LEASE, START, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_ack_completed(self, store):
        sent = await self.send(store)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        result = await ack(store, sent.id, "beta", m.lease_id, "completed", None, START)
        assert result == {"ok": True, "status": DONE, "attempts": 0}
        assert (await store.find(sent.id, START)).status == DONE
        assert await store.pull("beta", 10, self.LEASE, START + 10**6, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_retry_then_failed(self, store):
        sent = await self.send(store)
        for attempt in range(1, 5):
            (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
            result = await ack(store, sent.id, "beta", m.lease_id, "retry", f"e{attempt}", START)
            assert result["attempts"] == attempt
            assert result["status"] == (FAILED if attempt == 4 else QUEUED)
        found = await store.find(sent.id, START)
        assert found.status == FAILED and found.error == "e4" and found.attempts == 4
        assert await store.pull("beta", 1, self.LEASE, START, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_ack_errors(self, store):
        sent = await self.send(store)
        e = await _error(ack(store, "nope", "beta", "l", "completed", None, START))
        assert (e.status, e.code) == (404, "no_such_message")
        e = await _error(ack(store, sent.id, "beta", "l", "completed", None, START))
        assert (e.status, e.code) == (409, "not_leased")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        e = await _error(ack(store, sent.id, "gamma", m.lease_id, "completed", None, START))
        assert (e.status, e.code) == (403, "forbidden")
        e = await _error(ack(store, sent.id, "beta", "wrong", "completed", None, START))
        assert (e.status, e.code) == (409, "lease_mismatch")
        assert (await store.find(sent.id, START)).status == LEASED

    @pytest_twisted.ensureDeferred
    async def test_expired_lease_is_dead(self, store):
        sent = await self.send(store)
        (leased,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        old = leased.lease_id
        later = START + self.LEASE
        e = await _error(ack(store, sent.id, "beta", old, "completed", None, later))
        assert e.code == "not_leased"
        found = await store.find(sent.id, START)
        assert found.status == QUEUED, "the refused ack persisted the lapsed lease"
        assert found.lease_id is None and found.lease_until is None
        (leased,) = await store.pull("beta", 1, self.LEASE, later, RULES)
        new = leased.lease_id
        assert new != old
        e = await _error(ack(store, sent.id, "beta", old, "completed", None, later))
        assert e.code == "lease_mismatch"
        result = await ack(store, sent.id, "beta", new, "completed", None, later)
        assert result["status"] == DONE

    @pytest_twisted.ensureDeferred
    async def test_pull_releases_expired_leases_first(self, store):
        sent = await self.send(store)
        await store.pull("beta", 1, self.LEASE, START, RULES)
        assert await store.pull("beta", 1, self.LEASE, START + self.LEASE - 1, RULES) == []
        (again,) = await store.pull("beta", 1, self.LEASE, START + self.LEASE, RULES)
        assert again.id == sent.id and again.attempts == 0

    @pytest_twisted.ensureDeferred
    async def test_terminal_states_never_change(self, store):
        done = await self.send(store, id="done")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, done.id, "beta", m.lease_id, "completed", None, START)
        for outcome in ("completed", "retry"):
            e = await _error(ack(store, done.id, "beta", m.lease_id, outcome, None, START))
            assert e.code == "not_leased"
        await store.sweep_leases(START + 10**6, RULES)
        assert (await store.find(done.id, START)).status == DONE
        messages, _ = await store.poll("beta", None, 50, START + 10**6, RULES)
        assert messages == []

    @pytest_twisted.ensureDeferred
    async def test_settle_applies_any_transition(self, store):
        sent = await self.send(store, id="t")

        def stamp(message, now):
            message.error = f"seen at {int(now)}"
            return delivery.Outcome({"id": message.id, "status": message.status})

        assert await store.settle("t", stamp, START + 1, RULES) == {"id": sent.id,
                                                                   "status": QUEUED}
        assert (await store.find("t", START)).error == f"seen at {int(START) + 1}"

        def refuse(message, now):
            message.error = "kept although the transition raised"
            raise errors.RelayError(409, "wrong_state", "refused")

        e = await _error(store.settle("t", refuse, START, RULES))
        assert (e.status, e.code) == (409, "wrong_state")
        assert (await store.find("t", START)).error == "kept although the transition raised"
        e = await _error(store.settle("unknown", stamp, START, RULES))
        assert e.code == "no_such_message"

    @pytest_twisted.ensureDeferred
    async def test_sweep_leases(self, store):
        await self.send(store, to="beta")
        await self.send(store, to="gamma")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        await store.pull("gamma", 1, self.LEASE * 2, START, RULES)
        assert await store.sweep_leases(START + self.LEASE - 1, RULES) == 0
        assert await store.sweep_leases(START + self.LEASE, RULES) == 1
        assert (await store.query("beta", 1, {}, START + self.LEASE, RULES))[0].status == QUEUED
        assert await store.sweep_leases(START + self.LEASE * 2, RULES) == 1
        assert await store.sweep_leases(START + self.LEASE * 3, RULES) == 0

    @pytest_twisted.ensureDeferred
    async def test_a_lease_whose_deadline_moved_lapses_at_the_new_deadline(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="moved")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        heard.take()

        def extend(message, now):
            message.lease_until += 100_000
            return delivery.Outcome(message.lease_until)

        new_deadline = await store.settle("moved", extend, START, RULES)
        assert heard.take() == (set(), {(new_deadline / 1000.0, "beta")})
        assert await store.sweep_leases(START + self.LEASE, RULES) == 0
        assert await store.pull("beta", 1, self.LEASE, START + self.LEASE, RULES) == []
        found = await store.find("moved", START)
        assert (found.status, found.lease_id) == (LEASED, m.lease_id)
        assert await store.sweep_leases(START + self.LEASE + 100, RULES) == 1
        assert (await store.find("moved", START)).status == QUEUED

    # -- what changes mean for waiters ------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_changes_are_reported_once_durable(self, store):
        heard = Recorder()
        store.subscribe(heard)
        sent = await self.send(store, id="w")
        assert heard.take() == ({"beta"}, set())
        assert await store.add(new_message("alpha", "beta", START, id="w"), RULES) is False
        assert heard.take() == (set(), set())
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert heard.take() == (set(), {(START + self.LEASE, "beta")})
        await ack(store, sent.id, "beta", m.lease_id, "retry", None, START)
        assert heard.take() == ({"beta"}, set())
        (m,) = await store.pull("beta", 1, self.LEASE, START + 1, RULES)
        heard.take()
        await ack(store, sent.id, "beta", m.lease_id, "completed", None, START + 1)
        assert heard.take() == (set(), set())
        await self.send(store, id="lapses", to="gamma")
        await store.pull("gamma", 1, self.LEASE, START, RULES)
        heard.take()
        assert await store.sweep_leases(START + self.LEASE, RULES) == 1
        assert heard.take() == ({"gamma"}, set())
        assert heard.lapsed == 1

    @pytest_twisted.ensureDeferred
    async def test_each_lease_is_reported_held_then_released(self, store):
        """One ``held`` pair per lease granted or renewed, one ``released`` pair per
        lease ended before its deadline or moved from it: the broker keeps a deadline
        wake-up only while some lease still ends then."""
        heard = Recorder()
        store.subscribe(heard)
        for i in range(3):
            await self.send(store, id=f"h{i}")
        heard.heard = []
        leased = await store.pull("beta", 3, self.LEASE, START, RULES)
        deadline = (START + self.LEASE, "beta")
        assert [p for c in heard.heard for p in c.held] == [deadline] * 3
        heard.heard = []
        await ack(store, leased[0].id, "beta", leased[0].lease_id, "completed", None, START)
        await ack(store, leased[1].id, "beta", leased[1].lease_id, "retry", None, START)

        def extend(message, now):
            message.lease_until += 100_000
            return delivery.Outcome(message.lease_until)

        moved = await store.settle(leased[2].id, extend, START, RULES)
        assert sorted(p for c in heard.heard for p in c.released) == [deadline] * 3
        assert [p for c in heard.heard for p in c.held] == [(moved / 1000.0, "beta")]

    @pytest_twisted.ensureDeferred
    async def test_reads_release_lapsed_leases_and_report_them(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="r")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        heard.take()
        later = START + self.LEASE
        (entry,) = await store.status(["r"], "alpha", later, RULES)
        assert entry["status"] == QUEUED
        assert heard.take() == ({"beta"}, set())
        assert heard.lapsed == 1

    # -- status, recent, query -----------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_status_visibility(self, store):
        sent = await self.send(store, kind="request")
        entries = await store.status([sent.id, "unknown"], "alpha", START, RULES)
        assert entries == [
            {"id": sent.id, "status": QUEUED, "attempts": 0, "ts": sent.ts, "from": "alpha",
             "to": "beta", "kind": "request", "deliveries": 0},
            {"id": "unknown", "status": "not_found", "attempts": 0},
        ]
        assert (await store.status([sent.id], "beta", START, RULES))[0]["status"] == QUEUED
        assert await store.status([sent.id], "gamma", START, RULES) == [
            {"id": sent.id, "status": "not_found", "attempts": 0}
        ]

    @pytest_twisted.ensureDeferred
    async def test_status_reports_the_last_error(self, store):
        sent = await self.send(store)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, sent.id, "beta", m.lease_id, "retry", "disk full", START)
        (entry,) = await store.status([sent.id], "alpha", START, RULES)
        assert entry["error"] == "disk full" and entry["attempts"] == 1
        assert "error" not in (await store.find(sent.id, START)).envelope("beta")

    @pytest_twisted.ensureDeferred
    async def test_recent_newest_first_any_status(self, store):
        ids = [(await self.send(store, id=f"m{i}")).id for i in range(4)]
        await self.send(store, sender="beta", to="alpha")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        recent = await store.recent("beta", 3, START, RULES)
        assert [m.id for m in recent] == ids[::-1][:3]
        assert [m.id for m in await store.recent("beta", 50, START, RULES)] == ids[::-1]
        assert (await store.recent("beta", 50, START, RULES))[-1].status == LEASED

    @pytest_twisted.ensureDeferred
    async def test_query_filters(self, store):
        req = await self.send(store, id="req", kind="request")
        await self.send(store, id="plain")
        await self.send(store, sender="beta", to="alpha", id="rep", kind="reply", parentId="req")
        await self.send(store, sender="gamma", to="delta", id="foreign")
        await store.pull("beta", 1, self.LEASE, START, RULES)

        async def ids(agent, limit=50, kind=None, status=None, sender=None, to=None):
            filters = {"kind": kind, "status": status, "from": sender, "to": to}
            return [m.id for m in await store.query(agent, limit, filters, START, RULES)]

        # The caller's inbox only, as the reference broker searches: beta's "rep" to
        # alpha is alpha's, not beta's.
        assert await ids("beta") == ["plain", "req"]
        assert await ids("beta", limit=1) == ["plain"]
        assert await ids("beta", kind="request") == [req.id]
        assert await ids("beta", status=LEASED) == ["req"]
        assert await ids("beta", status=QUEUED) == ["plain"]
        assert await ids("beta", sender="alpha") == ["plain", "req"]
        assert await ids("beta", to="beta") == ["plain", "req"]
        assert await ids("beta", to="alpha") == []
        assert await ids("beta", sender="gamma") == []
        assert await ids("alpha", kind="reply") == ["rep"]
        assert await ids("alpha", kind="request") == []
        assert await ids("delta", sender="gamma", to="delta") == ["foreign"]

    # -- peers ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_peers(self, store):
        assert await store.peers() == []
        asked = store.is_registered("beta")
        assert isinstance(asked, Deferred), "one shape: a Deferred, answered at once or not"
        assert await asked is False
        await store.register("beta", START)
        await store.register("alpha", START + 5)
        await store.register("beta", START + 10)
        assert await store.peers() == [("alpha", int(START) + 5, None),
                                       ("beta", int(START) + 10, None)]
        assert await store.is_registered("beta") is True

    @pytest_twisted.ensureDeferred
    async def test_add_to_an_unregistered_recipient_is_refused_when_asked(self, store):
        """The registered-recipient rule (spec §2) in the operation that adds: 404
        ``no_such_agent`` before the duplicate and inbox checks, nothing stored."""
        await store.register("alpha", START)
        refused = await _error(store.add(new_message("alpha", "beta", START, id="early"),
                                         RULES, True))
        assert (refused.status, refused.code) == (404, "no_such_agent")
        assert await store.find("early", START) is None
        assert await store.add(new_message("beta", "alpha", START, id="back"), RULES,
                               True) is True
        await store.register("beta", START + 1)
        assert await store.add(new_message("alpha", "beta", START, id="early"), RULES,
                               True) is True
        assert await store.add(new_message("alpha", "nobody", START, id="any"), RULES) is True

    # -- message TTL ---------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_sweep_expired(self, store):
        old = await self.send(store, id="old", now=START)
        await store.pull("beta", 1, self.LEASE, START, RULES)
        await self.send(store, id="young", now=START + 100)
        assert await store.sweep_expired(START + 50, START + 50, RULES) == 1
        assert await store.find(old.id, START) is None
        e = await _error(ack(store, old.id, "beta", "x", "completed", None, START + 60))
        assert e.code == "no_such_message"
        assert [m.id for m in await store.recent("beta", 50, START, RULES)] == ["young"]
        assert await store.sweep_expired(START + 50, START + 50, RULES) == 0
        assert await store.status(["old"], "alpha", START, RULES) == [
            {"id": "old", "status": "not_found", "attempts": 0}
        ]

    # -- what operators see --------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_queue_depths_count_by_state(self, store):
        from relay.store.interface import QueueDepth

        assert await store.queue_depths(START) == []
        for i in range(4):
            await self.send(store, id=f"b{i}", to="beta", now=START + i)
        await self.send(store, id="g0", to="gamma", now=START + 10)
        await self.send(store, id="d0", to="delta", now=START + 11)
        (first,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        (second,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, first.id, "beta", first.lease_id, "completed", None, START)
        await ack(store, second.id, "beta", second.lease_id, "retry", "x", START,
                  make_rules(max_attempts=0))
        (d,) = await store.pull("delta", 1, self.LEASE, START, RULES)
        await ack(store, d.id, "delta", d.lease_id, "completed", None, START)
        (g,) = await store.pull("gamma", 1, self.LEASE, START, RULES)
        assert await store.queue_depths(START) == [
            QueueDepth("beta", queued=2, failed=1, oldest_queued=START + 2),
            QueueDepth("gamma", leased=1),
        ]
        await store.sweep_leases(START + self.LEASE, RULES)
        assert (await store.queue_depths(START))[1] == QueueDepth("gamma", queued=1,
                                                                  oldest_queued=START + 10)
        await store.sweep_expired(START + 3, START, RULES)
        assert await store.queue_depths(START) == [
            QueueDepth("beta", queued=1, oldest_queued=START + 3),
            QueueDepth("gamma", queued=1, oldest_queued=START + 10),
        ]

    @pytest_twisted.ensureDeferred
    async def test_queue_depths_tell_delayed_messages_apart(self, store):
        from relay.store.interface import QueueDepth

        await self.send(store, id="later", to="beta", now=START, delay_seconds=100)
        await self.send(store, id="now", to="beta", now=START + 1)
        assert await store.queue_depths(START + 1) == [
            QueueDepth("beta", queued=1, delayed=1, oldest_queued=START + 1)]
        (m,) = await store.pull("beta", 5, self.LEASE, START + 1, RULES)
        assert await store.queue_depths(START + 1) == [
            QueueDepth("beta", leased=1, delayed=1)]
        await ack(store, m.id, "beta", m.lease_id, "completed", None, START + 1)
        assert await store.queue_depths(START + 100) == [
            QueueDepth("beta", queued=1, oldest_queued=START)]
        (m,) = await store.pull("beta", 5, self.LEASE, START + 100, RULES)
        await ack(store, m.id, "beta", m.lease_id, "reject", "poison", START + 100)
        assert await store.queue_depths(START + 100) == [QueueDepth("beta", failed=1)]

    @pytest_twisted.ensureDeferred
    async def test_health_and_commit_timings(self, store):
        timings: List[float] = []
        store.observe_commits(timings.append)
        assert await store.health() is None
        await self.send(store)
        assert await store.health() is None
        assert all(isinstance(t, float) and t >= 0 for t in timings)


class QuotaContract(_Contract):
    """Inbox quotas, the agent cap and forgetting agents (``docs/SECURITY.md``) as
    every IMessageStore must apply them; needs a ``store`` fixture."""

    async def put(self, store, rules: Rules, **fields) -> Any:
        """``store.add`` of a message to beta under ``rules``: True, False or the error."""
        try:
            return await store.add(new_message("alpha", fields.pop("to", "beta"), START,
                                               **fields), rules)
        except errors.RelayError as e:
            return e

    @pytest_twisted.ensureDeferred
    async def test_a_full_inbox_refuses_new_messages_until_one_is_taken(self, store):
        rules = make_rules(inbox_max_messages=2)
        assert await self.put(store, rules, id="a") is True
        assert await self.put(store, rules, id="b") is True
        refused = await self.put(store, rules, id="c")
        assert (refused.status, refused.code) == (429, "inbox_full")
        assert "beta" in refused.message and "2 messages" in refused.message
        assert await self.put(store, rules, id="a") is False, "a duplicate stays a duplicate"
        assert await self.put(store, rules, id="c", to="gamma") is True, "per recipient"
        leased = await store.pull("beta", 2, self.LEASE, START, rules)
        assert (await self.put(store, rules, id="d")).code == "inbox_full", "leased counts"
        await ack(store, leased[0].id, "beta", leased[0].lease_id, "completed", None, START,
                  rules)
        assert await self.put(store, rules, id="d") is True
        assert (await store.find("d", START)).to == "beta"

    @pytest_twisted.ensureDeferred
    async def test_the_byte_limit_counts_utf8_bytes_of_the_body(self, store):
        one = new_message("alpha", "beta", START, id="x", body={"t": "\U0001F600" * 10})
        assert one.body_bytes() == len('{"t":""}') + 40, "UTF-8, not escapes"
        size = one.stored_bytes()
        assert size == one.body_bytes() + len("x" "alpha" "beta")
        rules = make_rules(inbox_max_bytes=2 * size)
        assert await self.put(store, rules, id="x", body=one.body) is True
        assert await self.put(store, rules, id="y", body=one.body) is True, "up to the limit"
        assert (await self.put(store, rules, id="z", body={})).code == "inbox_full"
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        await ack(store, m.id, "beta", m.lease_id, "reject", "no", START, rules)
        assert await self.put(store, rules, id="z", body=one.body) is True, "failed frees"

    @pytest_twisted.ensureDeferred
    async def test_the_byte_limit_counts_every_string_the_sender_chose(self, store):
        long = "\u00e9" * 200  # 400 UTF-8 bytes
        one = new_message("alpha", "beta", START, id="i" + long, body={},
                          replyTo="r" + long, rootId="o" + long, parentId="p" + long)
        assert one.stored_bytes() == len("{}") + 4 * 401 + len("alpha" "beta")
        rules = make_rules(inbox_max_bytes=2 * one.stored_bytes() - 1)
        assert await self.put(store, rules, id="i" + long, body={}, replyTo="r" + long,
                              rootId="o" + long, parentId="p" + long) is True
        refused = await self.put(store, rules, id="j" + long, body={}, replyTo="r" + long,
                                 rootId="o" + long, parentId="p" + long)
        assert (refused.status, refused.code) == (429, "inbox_full"), "ids count"
        assert await store.find("j" + long, START) is None
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        await ack(store, m.id, "beta", m.lease_id, "completed", None, START, rules)
        assert await self.put(store, rules, id="j" + long, body={}, replyTo="r" + long,
                              rootId="o" + long, parentId="p" + long) is True, "done frees"

    @pytest_twisted.ensureDeferred
    async def test_expiry_frees_the_inbox(self, store):
        rules = make_rules(inbox_max_messages=2)
        assert await self.put(store, rules, id="old") is True
        assert await store.add(new_message("alpha", "beta", START, id="brief",
                                           ttl_seconds=10), rules) is True
        assert (await self.put(store, rules, id="new")).code == "inbox_full"
        assert await store.sweep_expired(START - 1, START + 10, rules) == 1
        assert await self.put(store, rules, id="new") is True
        assert await store.sweep_expired(START + 1, START + 10, rules) == 2
        assert await self.put(store, rules, id="a") is True
        assert await self.put(store, rules, id="b") is True

    @pytest_twisted.ensureDeferred
    async def test_a_reply_into_a_full_inbox_is_refused_and_changes_nothing(self, store):
        rules = make_rules(inbox_max_messages=1)
        assert await self.put(store, rules, id="ask", kind="request") is True
        assert await store.add(new_message("gamma", "alpha", START, id="fill"), rules) is True
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        reply = {"id": "ans", "body": {}, "kind": "reply", "ack": False}
        transition = delivery.ack("beta", m.lease_id, "completed", None, rules, reply=reply)
        e = await _error(store.settle("ask", transition, START, rules))
        assert (e.status, e.code) == (429, "inbox_full")
        found = await store.find("ask", START)
        assert (found.status, found.lease_id) == (LEASED, m.lease_id), "the lease is intact"
        assert await store.find("ans", START) is None

    @pytest_twisted.ensureDeferred
    async def test_failure_notices_are_stored_into_a_full_inbox(self, store):
        rules = make_rules(inbox_max_messages=1)
        assert await self.put(store, rules, id="ask", kind="request") is True
        assert await store.add(new_message("gamma", "alpha", START, id="fill"), rules) is True
        (m,) = await store.pull("beta", 1, self.LEASE, START, rules)
        await settle(store, "ask", delivery.ack("beta", m.lease_id, "reject", "no", rules),
                     START, rules)
        notice = await store.find(delivery.notice_id("ask"), START)
        assert notice is not None and notice.to == "alpha", "the requester still learns"

    @pytest_twisted.ensureDeferred
    async def test_the_agent_cap_refuses_only_new_agents(self, store):
        await store.register("alpha", START, max_agents=2)
        await store.register("beta", START, max_agents=2)
        e = await _error(store.register("gamma", START, max_agents=2))
        assert (e.status, e.code) == (403, "forbidden") and "2 agents" in e.message
        await store.register("beta", START + 1, {"description": "x"}, max_agents=2)
        assert [name for name, _, _ in await store.peers()] == ["alpha", "beta"]
        await store.register("gamma", START, max_agents=0)  # 0: no limit

    @pytest_twisted.ensureDeferred
    async def test_forgetting_takes_only_long_offline_agents_with_no_messages(self, store):
        await store.register("idle", START, {"description": "gone"})
        await store.register("holder", START)
        await store.register("sender", START)
        await store.register("recent", START + 100)
        await self.send(store, sender="sender", to="holder", id="kept")
        (m,) = await store.pull("holder", 1, self.LEASE, START, RULES)
        await ack(store, m.id, "holder", m.lease_id, "completed", None, START)
        assert sorted(await store.forget_peers(START + 50)) == ["idle", "sender"]
        assert [name for name, _, _ in await store.peers()] == ["holder", "recent"]
        assert await store.is_registered("idle") is False
        assert await store.is_registered("holder") is True
        assert await store.forget_peers(START + 50) == []
        await store.register("idle", START + 60)
        assert [name for name, _, _ in await store.peers()] == ["holder", "idle", "recent"]
        assert await store.is_registered("idle") is True
        await store.sweep_expired(START + 1, START + 200, RULES)
        assert await store.forget_peers(START + 50) == ["holder"], "its messages are gone"

    def test_space_left_is_a_number_or_none(self, store):
        free = store.space_left()
        assert free is None or (isinstance(free, int) and free >= 0)


__all__ = ["ExtensionContract", "QuotaContract", "Recorder", "StoreContract", "SignedClient",
           "ack", "make_api", "make_config", "new_message"]


def settle(store, message_id: str, transition, now: float, rules: Rules = RULES):
    return store.settle(message_id, transition, now, rules)


class ExtensionContract(_Contract):
    """The delivery extensions v1.2 (EXTENSIONS.md) as every IMessageStore must apply
    them; needs a ``store`` fixture. Each test names the section it covers."""

    async def leased(self, store, now=START, lease=None, **fields) -> Message:
        await self.send(store, now=now, **fields)
        (m,) = await store.pull("beta", 1, lease or self.LEASE, now, RULES)
        return m

    async def notice_of(self, store, request_id: str, now=START):
        return await store.find(delivery.notice_id(request_id), now)

    # -- §1 renew ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_renew_moves_the_deadline_and_keeps_the_lease(self, store):
        m = await self.leased(store, id="r")
        result = await settle(store, "r", delivery.renew("beta", m.lease_id, 600), START + 50)
        deadline = int((START + 50) * 1000) + 600_000
        assert result == {"ok": True, "leaseId": m.lease_id, "leaseUntil": deadline}
        found = await store.find("r", START)
        assert (found.lease_id, found.lease_until, found.attempts, found.deliveries) == (
            m.lease_id, deadline, 0, 1), "a renewal is not a delivery"
        assert await store.sweep_leases(START + self.LEASE, RULES) == 0
        shorter = await settle(store, "r", delivery.renew("beta", m.lease_id, 1), START + 60)
        assert shorter["leaseUntil"] == int((START + 61) * 1000), "a renewal may shorten"

    @pytest_twisted.ensureDeferred
    async def test_renew_guards_in_order(self, store):
        m = await self.leased(store, id="r")
        e = await _error(settle(store, "nope", delivery.renew("beta", "x", 5), START))
        assert e.code == "no_such_message"
        e = await _error(settle(store, "r", delivery.renew("gamma", m.lease_id, 5), START))
        assert (e.status, e.code) == (403, "forbidden")
        e = await _error(settle(store, "r", delivery.renew("beta", "other", 5), START))
        assert (e.status, e.code) == (409, "lease_mismatch")
        e = await _error(settle(store, "r", delivery.renew("beta", m.lease_id, 5),
                                START + self.LEASE))
        assert e.code == "not_leased", "a passed deadline is not renewed, swept or not"
        assert (await store.find("r", START)).status == QUEUED

    # -- §2 outcomes ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_release_requeues_without_penalty(self, store):
        m = await self.leased(store, id="rel")
        result = await ack(store, "rel", "beta", m.lease_id, "release", None, START)
        assert result == {"ok": True, "status": QUEUED, "attempts": 0}
        (again,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        assert (again.id, again.attempts, again.deliveries) == ("rel", 0, 2)

    @pytest_twisted.ensureDeferred
    async def test_retry_after_holds_the_message_back(self, store):
        heard = Recorder()
        store.subscribe(heard)
        for outcome in ("retry", "release"):
            m = await self.leased(store, id=outcome)
            heard.take()
            transition = delivery.ack("beta", m.lease_id, outcome, "later", RULES, 30)
            await settle(store, outcome, transition, START)
            assert heard.take() == (set(), {(START + 30, "beta")})
            assert await store.pull("beta", 1, self.LEASE, START + 29, RULES) == []
            assert (await store.poll("beta", None, 50, START + 29, RULES))[0] == []
            (entry,) = await store.status([outcome], "alpha", START + 29, RULES)
            assert entry["notBefore"] == int((START + 30) * 1000) and entry["status"] == QUEUED
            (again,) = await store.pull("beta", 1, self.LEASE, START + 30, RULES)
            assert again.id == outcome
            (entry,) = await store.status([outcome], "alpha", START + 30, RULES)
            assert "notBefore" not in entry

    @pytest_twisted.ensureDeferred
    async def test_reject_fails_at_once_and_notifies_the_requester(self, store):
        m = await self.leased(store, id="poison", kind="request", rootId="conv")
        result = await ack(store, "poison", "beta", m.lease_id, "reject", None, START)
        assert result == {"ok": True, "status": FAILED, "attempts": 0}
        found = await store.find("poison", START)
        assert (found.status, found.error, found.dead_reason) == (FAILED, "rejected", "rejected")
        notice = await self.notice_of(store, "poison")
        assert notice.envelope() == {
            "id": delivery.notice_id("poison"), "from": "beta", "to": "alpha", "ts": notice.ts,
            "type": "message", "ack": False, "kind": "reply", "rootId": "conv",
            "parentId": "poison", "replyTo": "poison", "status": QUEUED, "attempts": 0,
            "leaseUntil": None,
            "body": {"relayNotice": {"event": "failed", "messageId": "poison", "attempts": 0,
                                     "deliveries": 1, "error": "rejected"}}}

    @pytest_twisted.ensureDeferred
    async def test_plain_messages_and_cancelled_requests_get_no_notice(self, store):
        m = await self.leased(store, id="plain")
        await ack(store, "plain", "beta", m.lease_id, "reject", "no", START)
        assert await self.notice_of(store, "plain") is None
        await self.send(store, id="req", kind="request")
        await settle(store, "req", delivery.cancel("alpha", None), START)
        assert await self.notice_of(store, "req") is None
        quiet = make_rules(max_attempts=3, notify_failures=False)
        m = await self.leased(store, id="quiet", kind="request")
        await ack(store, "quiet", "beta", m.lease_id, "reject", None, START, quiet)
        assert await self.notice_of(store, "quiet") is None

    @pytest_twisted.ensureDeferred
    async def test_retry_past_max_attempts_notifies_with_the_acks_error(self, store):
        rules = make_rules(max_attempts=0)
        m = await self.leased(store, id="q", kind="request")
        result = await ack(store, "q", "beta", m.lease_id, "retry", "tool crashed", START, rules)
        assert result == {"ok": True, "status": FAILED, "attempts": 1}
        found = await store.find("q", START)
        assert (found.error, found.dead_reason) == ("tool crashed", "attempts")
        body = (await self.notice_of(store, "q")).body["relayNotice"]
        assert body == {"event": "failed", "messageId": "q", "attempts": 1, "deliveries": 1,
                        "error": "tool crashed"}

    # -- §3 deliveries and dead letters --------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_max_deliveries_fails_a_message_whose_leases_keep_lapsing(self, store):
        rules = make_rules(max_attempts=3, max_deliveries=2)
        await self.send(store, id="crash", kind="request")
        now = START
        for _ in range(2):
            (m,) = await store.pull("beta", 1, self.LEASE, now, rules)
            now += self.LEASE
        # the second lease lapsed: failed as of its deadline, before any sweep
        assert await store.pull("beta", 1, self.LEASE, now, rules) == []
        found = await store.find("crash", now)
        assert (found.status, found.deliveries, found.dead_reason, found.error) == (
            FAILED, 2, "deliveries", "delivered 2 times without completion")
        notice = await self.notice_of(store, "crash", now)
        assert notice.body["relayNotice"]["error"] == "delivered 2 times without completion"

    @pytest_twisted.ensureDeferred
    async def test_an_exhausted_lapse_is_failed_by_an_ack_too(self, store):
        rules = make_rules(max_attempts=3, max_deliveries=1)
        m = await self.leased(store, id="x", kind="request")
        e = await _error(ack(store, "x", "beta", m.lease_id, "completed", None,
                             START + self.LEASE, rules))
        assert e.code == "not_leased"
        assert (await store.find("x", START)).status == FAILED
        assert await self.notice_of(store, "x") is not None
        for outcome in ("release", "retry"):
            m = await self.leased(store, id=outcome)
            await ack(store, outcome, "beta", m.lease_id, outcome, None, START, rules)
            found = await store.find(outcome, START)
            assert (found.status, found.error) == (FAILED,
                                                   "delivered 1 times without completion")

    @pytest_twisted.ensureDeferred
    async def test_requeue_resets_a_dead_letter(self, store):
        m = await self.leased(store, id="d")
        await ack(store, "d", "beta", m.lease_id, "reject", "bad", START)
        e = await _error(settle(store, "d", delivery.requeue("gamma"), START))
        assert (e.status, e.code) == (403, "forbidden")
        for agent in ("beta", "alpha", None):
            result = await settle(store, "d", delivery.requeue(agent), START)
            assert result == {"ok": True, "status": QUEUED, "attempts": 0}
            found = await store.find("d", START)
            assert (found.status, found.attempts, found.deliveries, found.error,
                    found.not_before, found.dead_reason) == (QUEUED, 0, 0, None, None, None)
            e = await _error(settle(store, "d", delivery.requeue(agent), START))
            assert (e.status, e.code) == (409, "wrong_state")
            m = await store.pull("beta", 1, self.LEASE, START, RULES)
            await ack(store, "d", "beta", m[0].lease_id, "reject", "bad", START)

    @pytest_twisted.ensureDeferred
    async def test_cancel_withdraws_and_kills_the_lease(self, store):
        m = await self.leased(store, id="c", kind="request")
        e = await _error(settle(store, "c", delivery.cancel("beta", None), START))
        assert (e.status, e.code) == (403, "forbidden")
        result = await settle(store, "c", delivery.cancel("alpha", None), START)
        assert result == {"ok": True, "status": FAILED, "attempts": 0}
        found = await store.find("c", START)
        assert (found.error, found.dead_reason) == ("cancelled by sender", "cancelled")
        e = await _error(ack(store, "c", "beta", m.lease_id, "completed", None, START))
        assert e.code == "not_leased"
        e = await _error(settle(store, "c", delivery.cancel("alpha", "again"), START))
        assert e.code == "wrong_state"
        e = await _error(settle(store, "c", delivery.requeue("beta"), START))
        assert e.code == "forbidden", "only the sender requeues a cancelled message"
        await settle(store, "c", delivery.requeue("alpha"), START)
        await self.send(store, id="q2")
        await settle(store, "q2", delivery.cancel("alpha", "changed my mind"), START)
        assert (await store.find("q2", START)).error == "changed my mind"

    # -- §4 notices are stored once -------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_one_notice_per_request(self, store):
        heard = Recorder()
        store.subscribe(heard)
        m = await self.leased(store, id="once", kind="request")
        heard.take()
        await ack(store, "once", "beta", m.lease_id, "reject", None, START)
        assert heard.take()[0] == {"alpha"}, "the notice wakes its recipient"
        await settle(store, "once", delivery.requeue("alpha"), START)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, "once", "beta", m.lease_id, "reject", "again", START)
        notices = await store.query("alpha", 50, {"kind": "reply"}, START, RULES)
        assert [n.id for n in notices] == [delivery.notice_id("once")]
        assert notices[0].body["relayNotice"]["error"] == "rejected", "the first one stays"

    # -- §5 conversations ----------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_pull_by_parent_leases_only_the_answers(self, store):
        await self.send(store, sender="beta", to="alpha", id="other")
        await self.send(store, sender="beta", to="alpha", id="a1", kind="reply", parentId="q")
        await self.send(store, sender="beta", to="alpha", id="a2", replyTo="q")
        await self.send(store, sender="beta", to="gamma", id="elsewhere", parentId="q")
        leased = await store.pull("alpha", 10, self.LEASE, START, RULES, "q")
        assert [m.id for m in leased] == ["a1", "a2"]
        assert await store.pull("alpha", 10, self.LEASE, START, RULES, "q") == []
        assert [m.id for m in await store.pull("alpha", 10, self.LEASE, START, RULES)] == [
            "other"]

    @pytest_twisted.ensureDeferred
    async def test_thread(self, store):
        await self.send(store, id="root", kind="request")
        await self.send(store, sender="beta", to="alpha", id="ans", rootId="root",
                        parentId="root", kind="reply")
        await self.send(store, sender="gamma", to="delta", id="foreign", rootId="root")
        await self.send(store, id="next", rootId="root", kind="request")
        await self.send(store, id="unrelated")

        async def page(agent, root="root", since=None, limit=50):
            messages, cursor = await store.thread(agent, root, since, limit, START, RULES)
            return [m.id for m in messages], cursor

        assert await page("alpha") == (["root", "ans", "next"], "next")
        assert await page("beta", limit=2) == (["root", "ans"], "ans")
        assert await page("beta", since="ans") == (["next"], "next")
        assert await page("beta", since="next") == ([], "next")
        assert await page("beta", since="unknown") == (["root", "ans", "next"], "next")
        assert await page("delta") == (["foreign"], "foreign")
        assert await page("beta", root="nothing") == ([], None)
        assert await page("beta", root="nothing", since="ans") == ([], None)

    @pytest_twisted.ensureDeferred
    async def test_query_boxes_and_conversation_filters(self, store):
        await self.send(store, id="q1", kind="request")
        await self.send(store, sender="beta", to="alpha", id="r1", kind="reply", parentId="q1",
                        rootId="q1")
        await self.send(store, sender="beta", to="alpha", id="r2", replyTo="q1")
        await self.send(store, sender="gamma", to="alpha", id="g1", rootId="q1")

        async def ids(agent, **filters):
            return [m.id for m in await store.query(agent, 50, filters, START, RULES)]

        assert await ids("beta") == ["q1"]
        assert await ids("beta", box="inbox") == ["q1"]
        assert await ids("beta", box="sent") == ["r2", "r1"]
        assert await ids("beta", box="all") == ["r2", "r1", "q1"]
        assert await ids("beta", box="sent", to="alpha", kind="reply") == ["r1"]
        assert await ids("beta", box="sent", **{"from": "alpha"}) == []
        assert await ids("alpha", rootId="q1") == ["g1", "r1"]
        assert await ids("alpha", box="all", rootId="q1") == ["g1", "r1", "q1"]
        assert await ids("alpha", parentId="q1") == ["r2", "r1"]
        assert await ids("alpha", parentId="q1", status=QUEUED, box="all") == ["r2", "r1"]

    # -- §6 reply in the ack ---------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_reply_in_the_ack_is_stored_with_the_completion(self, store):
        heard = Recorder()
        store.subscribe(heard)
        m = await self.leased(store, id="ask", kind="request", rootId="conv")
        heard.take()
        reply = {"id": "ans", "body": {"text": "42"}, "kind": "reply", "ack": True}
        transition = delivery.ack("beta", m.lease_id, "completed", None, RULES, reply=reply)
        result = await settle(store, "ask", transition, START + 1)
        assert result == {"ok": True, "status": DONE, "attempts": 0, "replyId": "ans",
                          "duplicate": False}
        answer = await store.find("ans", START)
        assert (answer.sender, answer.to, answer.parent_id, answer.reply_to, answer.root_id,
                answer.kind, answer.ack, answer.body) == ("beta", "alpha", "ask", "ask", "conv",
                                                          "reply", True, {"text": "42"})
        assert heard.take() == ({"alpha"}, set())

    @pytest_twisted.ensureDeferred
    async def test_a_reply_id_in_use_changes_nothing(self, store):
        await self.send(store, sender="gamma", to="delta", id="taken")
        m = await self.leased(store, id="ask")
        reply = {"id": "taken", "body": {}, "kind": "reply", "ack": False}
        transition = delivery.ack("beta", m.lease_id, "completed", None, RULES, reply=reply)
        e = await _error(settle(store, "ask", transition, START))
        assert (e.status, e.code) == (409, "id_conflict")
        found = await store.find("ask", START)
        assert (found.status, found.lease_id) == (LEASED, m.lease_id), "the lease is intact"
        assert (await store.find("taken", START)).sender == "gamma"

    @pytest_twisted.ensureDeferred
    async def test_an_ack_with_a_reply_retried_is_a_duplicate_of_one_settle(self, store):
        m = await self.leased(store, id="ask", kind="request")
        reply = {"id": "ans", "body": {}, "kind": "reply", "ack": False}
        transition = delivery.ack("beta", m.lease_id, "completed", None, RULES, reply=reply)
        assert (await settle(store, "ask", transition, START))["duplicate"] is False
        again = await settle(store, "ask", transition, START + 1)
        assert again == {"ok": True, "status": DONE, "attempts": 0, "replyId": "ans",
                         "duplicate": True}
        other = delivery.ack("gamma", "whatever", "completed", None, RULES, reply=reply)
        e = await _error(settle(store, "ask", other, START + 1))
        assert (e.status, e.code) == (403, "forbidden"), "another sender's retry is no duplicate"
        answers = await store.query("alpha", 10, {"parentId": "ask"}, START + 1, RULES)
        assert [a.id for a in answers] == ["ans"], "stored once"

    @pytest_twisted.ensureDeferred
    async def test_a_transition_with_a_stored_message_sees_it_in_its_settle(self, store):
        await self.send(store, id="m")
        await self.send(store, id="near", sender="gamma", to="delta")
        await self.send(store, id="brief", ttl_seconds=5)
        seen = []

        def decide(message, other, now):
            seen.append((message.id, None if other is None else (other.id, other.sender)))
            message.error = "looked"
            return delivery.Outcome("decided")

        for other_id in ("near", "absent", "brief"):
            result = await settle(store, "m", delivery.WithStored(other_id, decide), START + 10)
            assert result == "decided"
        assert seen == [("m", ("near", "gamma")), ("m", None), ("m", None)], \
            "an expired message is not seen"
        assert (await store.find("m", START + 10)).error == "looked"

    @pytest_twisted.ensureDeferred
    async def test_a_receipt_is_one_settle_storing_an_ack_back_to_the_sender(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="m1")
        heard.take()
        receipt_id = await settle(store, "m1", delivery.receipt("beta", b'{"status": "ok"}'),
                                  START + 1)
        receipt = await store.find(receipt_id, START + 1)
        assert (receipt.type, receipt.sender, receipt.to, receipt.reply_to, receipt.body) == (
            "ack", "beta", "alpha", "m1", {"status": "ok"})
        assert (await store.find("m1", START + 1)).status == QUEUED
        assert heard.take() == ({"alpha"}, set())
        e = await _error(settle(store, "m1", delivery.receipt("alpha", b"{}"), START + 1))
        assert (e.status, e.code) == (403, "forbidden")

    # -- §7 TTL and delay ------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_a_delayed_message_waits_and_is_visible_with_not_before(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="later", delay_seconds=60)
        assert heard.take() == (set(), {(START + 60, "beta")})
        await self.send(store, id="now")
        leased = await store.pull("beta", 10, self.LEASE * 10, START, RULES)
        assert [m.id for m in leased] == ["now"]
        view = (await store.recent("beta", 2, START, RULES))[1]
        assert view.id == "later" and view.status == QUEUED
        assert view.envelope("beta", START)["notBefore"] == iso_timestamp(START + 60)
        assert "notBefore" not in view.envelope("beta", START + 60)
        (entry,) = await store.status(["later"], "alpha", START, RULES)
        assert entry["notBefore"] == int((START + 60) * 1000)
        (m,) = await store.pull("beta", 10, self.LEASE, START + 60, RULES)
        assert m.id == "later"

    @pytest_twisted.ensureDeferred
    async def test_a_v10_cursor_that_passed_a_delayed_message_gets_it_once(self, store):
        await self.send(store, id="later", delay_seconds=60)
        await self.send(store, id="after")
        messages, cursor = await store.poll("beta", None, 50, START, RULES)
        assert [m.id for m in messages] == ["after"] and cursor == "after"
        assert (await store.poll("beta", cursor, 50, START + 59, RULES))[0] == []
        messages, cursor2 = await store.poll("beta", cursor, 50, START + 60, RULES)
        assert [m.id for m in messages] == ["later"] and cursor2 == "after"
        assert (await store.poll("beta", cursor, 50, START + 61, RULES))[0] == []
        await self.send(store, id="late2", delay_seconds=10)
        messages, _ = await store.poll("beta", cursor, 50, START + 100, RULES)
        assert [m.id for m in messages] == ["late2"], "a fresh due message: once, no repeat"
        assert (await store.poll("beta", "late2", 50, START + 101, RULES))[0] == []

    @pytest_twisted.ensureDeferred
    async def test_a_message_past_its_ttl_is_gone(self, store):
        m = await self.leased(store, id="held", ttl_seconds=10)
        await self.send(store, id="brief", ttl_seconds=10, kind="request")
        later = START + 10
        assert await store.pull("beta", 10, self.LEASE, later, RULES) == []
        assert await store.find("brief", later) is None
        assert (await store.status(["brief"], "alpha", later, RULES))[0]["status"] == "not_found"
        assert await store.recent("beta", 50, later, RULES) == []
        e = await _error(ack(store, "held", "beta", m.lease_id, "completed", None, later))
        assert e.code == "no_such_message", "a lease on an expired message dies"
        assert await store.sweep_expired(START - 1, later, RULES) == 2
        notice = await self.notice_of(store, "brief", later)
        assert notice.body["relayNotice"] == {"event": "expired", "messageId": "brief",
                                              "attempts": 0, "deliveries": 0,
                                              "error": "expired unprocessed"}
        assert await store.sweep_expired(START - 1, later, RULES) == 0
        (entry,) = await store.status([delivery.notice_id("brief")], "alpha", later, RULES)
        assert entry["status"] == QUEUED and "expiresAt" not in entry

    @pytest_twisted.ensureDeferred
    async def test_ttl_fields_in_views(self, store):
        sent = await self.send(store, id="t", ttl_seconds=3600)
        found = await store.find("t", START)
        assert found.envelope()["expiresAt"] == iso_timestamp(START + 3600)
        assert found.envelope()["ts"] == sent.ts
        (entry,) = await store.status(["t"], "beta", START, RULES)
        assert entry["expiresAt"] == int((START + 3600) * 1000)

    @pytest_twisted.ensureDeferred
    async def test_an_expired_request_removed_by_age_is_notified_once(self, store):
        await self.send(store, id="old", kind="request", now=START)
        await self.send(store, id="done", kind="request", now=START)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, m.id, "beta", m.lease_id, "completed", None, START)
        assert await store.sweep_expired(START + 1, START + 1, RULES) == 2
        remaining = await store.query("alpha", 50, {}, START + 1, RULES)
        assert [n.id for n in remaining] == [delivery.notice_id("done")] or [
            n.id for n in remaining] == [delivery.notice_id("old")]
        (notice,) = remaining
        assert notice.body["relayNotice"]["event"] == "expired"

    # -- §8 cards ---------------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_cards_are_kept_replaced_and_removed(self, store):
        card = {"description": "answers ünicode questions", "skills": ["search", "sql"]}
        await store.register("beta", START, card)
        await store.register("alpha", START)
        await store.register("beta", START + 5)
        assert await store.peers() == [("alpha", int(START), None),
                                       ("beta", int(START) + 5, card)]
        (_, (_, _, returned)) = await store.peers()
        returned["skills"].append("forged")
        assert (await store.peers())[1][2] == card
        await store.register("beta", START + 6, {})
        assert (await store.peers())[1][2] == {}
        await store.register("beta", START + 7, None)
        assert (await store.peers())[1] == ("beta", int(START) + 7, None)


class EventContract(_Contract):
    """REACH §11 events as a store records them: with the change that causes them,
    in order per agent, resumable without loss or repeat, and trimmed by retention."""

    async def read(self, store, agent: str, after: Optional[int], limit: int = 100):
        return await store.events(agent, after, limit)

    async def events_of(self, store, agent: str, after: int = 0) -> List[Tuple[str, Dict]]:
        page = await self.read(store, agent, after)
        assert page.reset is None
        return [(e.type, json.loads(e.data)) for e in page.events]

    @pytest_twisted.ensureDeferred
    async def test_a_send_pull_and_ack_record_their_events(self, store):
        sent = await self.send(store, id="m1", kind="request", rootId="r", parentId="p",
                               body={"text": "never in an event"})
        assert await self.events_of(store, "beta") == [
            ("message", {"id": "m1", "from": "alpha", "to": "beta", "kind": "request",
                         "rootId": "r", "parentId": "p"})]
        (leased,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await ack(store, sent.id, "beta", leased.lease_id, "reject", "bad input", START)
        seen = await self.events_of(store, "alpha")
        assert seen[:2] == [
            ("status", {"id": "m1", "to": "beta", "status": LEASED, "attempts": 0,
                        "deliveries": 1}),
            ("status", {"id": "m1", "to": "beta", "status": FAILED, "attempts": 0,
                        "deliveries": 1, "error": "bad input"}),
        ]
        # the failure notice to the sender is a message like any other
        assert seen[2][0] == "message" and seen[2][1]["parentId"] == "m1"
        everything = await self.read(store, "alpha", 0)
        assert "never in an event" not in repr(everything)
        assert await self.events_of(store, "beta") == [("message", {
            "id": "m1", "from": "alpha", "to": "beta", "kind": "request", "rootId": "r",
            "parentId": "p"})]

    @pytest_twisted.ensureDeferred
    async def test_a_lapsed_lease_is_a_new_message_event_and_a_status(self, store):
        await self.send(store, id="m1")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        await store.sweep_leases(START + self.LEASE + 1, RULES)
        kinds = [(t, d["id"], d.get("status")) for t, d in await self.events_of(store, "beta")]
        assert kinds == [("message", "m1", None), ("message", "m1", None)]
        statuses = [d["status"] for _, d in await self.events_of(store, "alpha")]
        assert statuses == [LEASED, QUEUED]

    @pytest_twisted.ensureDeferred
    async def test_resume_gives_exactly_the_events_after_the_id(self, store):
        for i in range(5):
            await self.send(store, id=f"m{i}")
        page = await self.read(store, "beta", 0)
        ids = [e.id for e in page.events]
        assert ids == sorted(ids) and len(set(ids)) == 5
        await self.send(store, to="gamma", id="other")
        for i in range(5, 8):
            await self.send(store, id=f"m{i}")
        resumed = await self.read(store, "beta", ids[2])
        assert [json.loads(e.data)["id"] for e in resumed.events] == [
            "m3", "m4", "m5", "m6", "m7"]
        assert resumed.last == resumed.events[-1].id
        small = await self.read(store, "beta", ids[2], limit=2)
        assert [json.loads(e.data)["id"] for e in small.events] == ["m3", "m4"]
        again = await self.read(store, "beta", small.last)
        assert [json.loads(e.data)["id"] for e in again.events] == ["m5", "m6", "m7"]
        assert (await self.read(store, "beta", again.last)).events == []

    @pytest_twisted.ensureDeferred
    async def test_no_position_starts_at_the_present(self, store):
        await self.send(store, id="m0")
        page = await self.read(store, "beta", None)
        assert page.events == [] and page.reset is None
        await self.send(store, id="m1")
        later = await self.read(store, "beta", page.last)
        assert [json.loads(e.data)["id"] for e in later.events] == ["m1"]

    @pytest_twisted.ensureDeferred
    async def test_an_unknown_or_trimmed_position_is_a_reset(self, store):
        await self.send(store, id="old", now=START)
        first = (await self.read(store, "beta", 0)).events[0].id
        await self.send(store, id="new", now=START + 100)
        unknown = await self.read(store, "beta", first + 1000)
        assert unknown.reset == "unknown event id" and unknown.events == []
        assert (await self.read(store, "beta", -1)).reset == "unknown event id"
        assert await store.trim_events(START + 50) == 1
        trimmed = await self.read(store, "beta", 0)
        assert trimmed.reset is not None and "eventRetentionSeconds" in trimmed.reset
        assert trimmed.last >= first + 1
        kept = await self.read(store, "beta", first)
        assert [json.loads(e.data)["id"] for e in kept.events] == ["new"]

    @pytest_twisted.ensureDeferred
    async def test_retention_resets_only_a_stream_that_lost_events_of_its_own(self, store):
        # beta's last event is old; other agents' events, older than retention,
        # raise the floor past it: beta lost nothing, and resumes.
        await self.send(store, id="b1", now=START)
        await self.send(store, id="b2", now=START)
        b1, b2 = [e.id for e in (await self.read(store, "beta", 0)).events]
        for i in range(3):
            await self.send(store, to="gamma", id=f"g{i}", now=START + 1)
        assert await store.trim_events(START + 50) == 5  # the floor is past b2 now
        await self.send(store, id="b3", now=START + 100)
        resumed = await self.read(store, "beta", b2)
        assert resumed.reset is None, "nothing of beta's was removed after b2"
        assert [json.loads(e.data)["id"] for e in resumed.events] == ["b3"]
        lost = await self.read(store, "beta", b1)
        assert lost.reset is not None and lost.events == [], "b2 was removed after b1"
        assert (await self.read(store, "gamma", 0)).reset is not None
        # later trims move each agent's newest removed event along
        await self.send(store, to="gamma", id="g3", now=START + 101)
        assert await store.trim_events(START + 200) == 2
        b3 = resumed.events[0].id
        again = await self.read(store, "beta", b3)
        assert again.reset is None and again.events == []
        assert (await self.read(store, "beta", b2)).reset is not None

    @pytest_twisted.ensureDeferred
    async def test_a_delay_records_its_message_event_when_it_ends(self, store):
        await self.send(store, id="later", now=START, delay_seconds=60)
        await self.send(store, id="now", now=START)
        assert [d["id"] for _, d in await self.events_of(store, "beta")] == ["now"]
        assert await store.release_due(START + 59) == 0
        assert await store.release_due(START + 60) == 1
        assert await store.release_due(START + 61) == 0, "released once"
        assert [d["id"] for _, d in await self.events_of(store, "beta")] == ["now", "later"]
        pulled = await store.pull("beta", 5, self.LEASE, START + 61, RULES)
        assert sorted(m.id for m in pulled) == ["later", "now"]

    @pytest_twisted.ensureDeferred
    async def test_webhook_states_are_kept_per_agent(self, store):
        assert await store.webhook_states() == {}
        await store.put_webhook("beta", '{"acked":3}')
        await store.put_webhook("gamma", '{"acked":1}')
        await store.put_webhook("beta", '{"acked":4}')
        assert await store.webhook_states() == {"beta": '{"acked":4}', "gamma": '{"acked":1}'}
        await store.put_webhook("gamma", None)
        await store.put_webhook("nobody", None)
        assert await store.webhook_states() == {"beta": '{"acked":4}'}

    @pytest_twisted.ensureDeferred
    async def test_a_webhook_merge_keeps_what_it_does_not_set(self, store):
        heard = Recorder()
        store.subscribe(heard)
        first = await store.merge_webhook("beta", {"url": "u1"}, {"acked": 7})
        assert json.loads(first) == {"url": "u1", "acked": 7}
        second = await store.merge_webhook("beta", {"acked": 9}, {"acked": 1}, False)
        assert json.loads(second) == {"url": "u1", "acked": 9}
        assert (await store.webhook_states())["beta"] == second
        hooks = set()
        for changes in heard.heard:
            hooks |= changes.hooks
        assert hooks == {"beta"}, "a progress write is not announced"

    @pytest_twisted.ensureDeferred
    async def test_one_broker_at_a_time_delivers_webhooks(self, store):
        from relay.store.interface import ISharedNonces

        assert await store.lead_webhooks("a", START, 15) is True
        if not ISharedNonces.providedBy(store):  # one broker writes this store
            assert await store.lead_webhooks("b", START + 5, 15) is True
            return
        assert await store.lead_webhooks("b", START + 5, 15) is False
        assert await store.lead_webhooks("a", START + 10, 15) is True
        assert await store.lead_webhooks("b", START + 24, 15) is False
        assert await store.lead_webhooks("b", START + 26, 15) is True, "a lapsed role moves"
        assert await store.lead_webhooks("b", START + 30, 0) is True  # handed over
        assert await store.lead_webhooks("a", START + 30.5, 15) is True
        assert "*" not in await store.webhook_states()

    @pytest_twisted.ensureDeferred
    async def test_changes_name_the_agents_with_new_events(self, store):
        heard = Recorder()
        store.subscribe(heard)
        await self.send(store, id="m1")
        await store.pull("beta", 1, self.LEASE, START, RULES)
        agents = set()
        for changes in heard.heard:
            agents |= changes.events
        assert agents == {"alpha", "beta"}


class GroupContract(_Contract):
    """REACH §13 group sends as every IMessageStore must store them; needs a ``store``
    fixture: all copies or none, a repeat answered with the first copies, the status
    of the sent id, and the copies as ordinary messages in every view."""

    def copies(self, sent_id: str = "g1", members=("bob", "carol", "alice"),
               sender: str = "alice", now: float = START, **fields: Any) -> List[Message]:
        sent = new_message(sender, "group:team", now, id=sent_id, **fields)
        return delivery.group_copies(sent, "group:team", members)

    @pytest_twisted.ensureDeferred
    async def test_every_copy_is_stored_as_a_message_of_its_own(self, store):
        copies = self.copies(kind="request")
        assert [c.to for c in copies] == ["bob", "carol"], "the sender gets none"
        stored, answered = await store.add_group(copies, "alice", "g1", RULES)
        assert stored is True and [c.id for c in answered] == [c.id for c in copies]
        for copy in copies:
            (leased,) = await store.pull(copy.to, 10, self.LEASE, START, RULES)
            assert (leased.id, leased.via, leased.sent_id) == (copy.id, "group:team", "g1")
            assert (leased.root_id, leased.kind, leased.sender) == ("g1", "request", "alice")
        assert await store.find("g1", START) is None, "the sent id is not a message"

    @pytest_twisted.ensureDeferred
    async def test_a_repeat_answers_the_first_copies_whatever_the_members_now(self, store):
        first = self.copies()
        await store.add_group(first, "alice", "g1", RULES)
        stored, answered = await store.add_group(self.copies(members=("dan",)), "alice",
                                                 "g1", RULES)
        assert stored is False
        assert [(c.to, c.id) for c in answered] == [(c.to, c.id) for c in first]
        assert await store.pull("dan", 10, self.LEASE, START, RULES) == []
        # another sender's send under the same id is its own
        stored, other = await store.add_group(self.copies(sender="bob"), "bob", "g1", RULES)
        assert stored is True and {c.to for c in other} == {"alice", "carol"}

    @pytest_twisted.ensureDeferred
    async def test_one_full_inbox_refuses_every_copy(self, store):
        rules = replace(RULES, inbox_max_messages=1)
        await store.add(new_message("dan", "carol", START, id="fill"), rules)
        with pytest.raises(errors.RelayError) as info:
            await store.add_group(self.copies(), "alice", "g1", rules)
        assert (info.value.status, info.value.code) == (429, "inbox_full")
        assert await store.pull("bob", 10, self.LEASE, START, rules) == []
        (entry,) = await store.status(["g1"], "alice", START, rules)
        assert entry["status"] == "not_found"

    @pytest_twisted.ensureDeferred
    async def test_a_sent_id_or_copy_id_in_use_is_a_conflict_and_stores_nothing(self, store):
        await self.send(store, sender="alice", to="dan", id="taken")
        with pytest.raises(errors.RelayError) as info:
            await store.add_group(self.copies("taken"), "alice", "taken", RULES)
        assert info.value.code == "id_conflict"
        squatter = self.copies()[1]
        await self.send(store, sender="mallory", to="carol", id=squatter.id)
        with pytest.raises(errors.RelayError) as info:
            await store.add_group(self.copies(), "alice", "g1", RULES)
        assert info.value.code == "id_conflict"
        assert await store.pull("bob", 10, self.LEASE, START, RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_the_status_of_the_sent_id_is_its_senders_only(self, store):
        copies = self.copies()
        await store.add_group(copies, "alice", "g1", RULES)
        (leased,) = await store.pull("bob", 1, self.LEASE, START, RULES)
        (entry,) = await store.status(["g1"], "alice", START, RULES)
        assert entry == {"id": "g1", "via": "group:team", "copies": [
            {"to": "bob", "id": copies[0].id, "status": LEASED},
            {"to": "carol", "id": copies[1].id, "status": QUEUED}]}
        for other in ("bob", "carol"):
            (hidden,) = await store.status(["g1"], other, START, RULES)
            assert hidden["status"] == "not_found"

    @pytest_twisted.ensureDeferred
    async def test_copies_are_in_the_sent_box_and_the_thread_and_expire(self, store):
        copies = self.copies(ttl_seconds=60)
        await store.add_group(copies, "alice", "g1", RULES)
        ids = [c.id for c in copies]
        sent = await store.query("alice", 10, {"box": "sent"}, START, RULES)
        assert sorted(m.id for m in sent) == sorted(ids)
        thread, _ = await store.thread("alice", "g1", None, 10, START, RULES)
        assert [m.id for m in thread] == ids
        await store.sweep_expired(START - 1, START + 61, RULES)
        (entry,) = await store.status(["g1"], "alice", START + 61, RULES)
        assert entry["status"] == "not_found"


class Wire2Contract(_Contract):
    """The v2/v3 wire's messages in the one store (WIRE-V2 §3) as every IMessageStore
    keeps them; needs a ``store`` fixture."""

    async def send_v2(self, store, message_id: str, sender="alpha", to="beta", now=START,
                      mode="continue", ref="sess-1", shared=True, kind="request"
                      ) -> Message:
        from relay.wire.v2 import views

        body = views.stored_body("hé ☃", "ctx", "topic-a", mode, ref)
        message = Message(id=message_id, sender=sender, to=to, created=now,
                          body_json=views.canonical_json(body), kind=kind, root_id="root-9",
                          expires_at=now + 600, v2=views.v2_meta(mode, ref, shared))
        assert await store.add(message, RULES) is True
        return message

    @pytest_twisted.ensureDeferred
    async def test_a_v2_message_keeps_its_wire_fields_through_its_life(self, store):
        from relay.wire.v2 import views

        await self.send_v2(store, "v2-1")
        await self.send(store, id="seed-1")
        found = await store.find("v2-1", START)
        assert views.read_meta(found) == ("continue", "sess-1", True)
        assert views.shown_body(found) == ("hé ☃", "ctx", "topic-a")
        assert (await store.find("seed-1", START)).v2 is None
        leased = await store.pull("beta", 5, self.LEASE, START, RULES)
        assert {m.id: m.v2 for m in leased} == {"v2-1": found.v2, "seed-1": None}
        await ack(store, "v2-1", "beta", leased[0].lease_id, "completed", None, START)
        (done,) = await store.query("alpha", 5, {"box": "sent", "rootId": "root-9"}, START,
                                    RULES)
        assert (done.status, done.v2, done.expires_at) == (DONE, found.v2, START + 600)

    @pytest_twisted.ensureDeferred
    async def test_a_v2_request_that_fails_leaves_a_v2_notice_in_text(self, store):
        from relay.rules.v2 import transitions
        from relay.wire.v2 import views

        await self.send_v2(store, "v2-req", mode="write", shared=True)
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        await store.settle("v2-req", delivery.ack("beta", m.lease_id, "reject", "no", RULES),
                           START + 1, RULES)
        notice = await store.find(delivery.notice_id("v2-req"), START + 1)
        assert (notice.sender, notice.to, notice.kind, notice.parent_id) == (
            "beta", "alpha", "reply", "v2-req")
        assert views.read_meta(notice) == ("write", "sess-1", False)
        text, _, topic = views.shown_body(notice)
        assert text.startswith("[Relay] Your relay message was not delivered")
        assert "reason: no" in text and "hé ☃" in text and topic == "topic-a"
        assert notice.expires_at == START + 1 + views.NOTICE_TTL_SECONDS
        # and the v2 transitions guard as the reference does
        error = await _error(store.settle("v2-req", transitions.ack("alpha", "", "completed",
                                                                    None, RULES), START, RULES))
        assert (error.status, error.code) == (403, "forbidden")
        error = await _error(store.settle("v2-req", transitions.ack("beta", "", "completed",
                                                                    None, RULES), START, RULES))
        assert (error.status, error.code) == (400, "bad_request")

    @pytest_twisted.ensureDeferred
    async def test_v2_acks_with_and_without_a_token(self, store):
        from relay.rules.v2 import transitions

        await self.send_v2(store, "a")
        (m,) = await store.pull("beta", 1, self.LEASE, START, RULES)
        error = await _error(store.settle("a", transitions.ack("beta", "stale", "completed",
                                                               None, RULES), START, RULES))
        assert (error.status, error.code) == (409, "lease_mismatch")
        renewed = await store.settle("a", transitions.renew("beta", m.lease_id, 300),
                                     START + 10, RULES)
        assert renewed == {"ok": True, "lease_until": START + 310}
        assert await store.settle("a", transitions.ack("beta", m.lease_id, "retry", "later",
                                                       RULES), START + 11, RULES) == {"ok": True}
        (again,) = await store.pull("beta", 1, self.LEASE, START + 12, RULES)
        assert again.deliveries == 2 and again.error == "later"
        assert await store.settle("a", transitions.ack("beta", "", "completed", None, RULES),
                                  START + 13, RULES) == {"ok": True}
        error = await _error(store.settle("a", transitions.renew("beta", again.lease_id, 60),
                                          START + 14, RULES))
        assert (error.status, error.code) == (409, "lease_mismatch")

    @pytest_twisted.ensureDeferred
    async def test_v2_requeue_and_cancel(self, store):
        from relay.rules.v2 import transitions

        await self.send_v2(store, "r")
        error = await _error(store.settle("r", transitions.requeue("beta"), START, RULES))
        assert (error.status, error.code) == (404, "no_such_message")  # queued already
        await store.pull("beta", 1, self.LEASE, START, RULES)
        error = await _error(store.settle("r", transitions.requeue("alpha"), START, RULES))
        assert (error.status, error.code) == (403, "forbidden")
        assert await store.settle("r", transitions.requeue("beta"), START, RULES) == {
            "ok": True, "message_id": "r"}
        found = await store.find("r", START)
        assert (found.status, found.deliveries, found.lease_id) == (QUEUED, 0, None)
        error = await _error(store.settle("r", transitions.cancel("beta"), START, RULES))
        assert (error.status, error.code) == (403, "forbidden")
        assert await store.settle("r", transitions.cancel("alpha"), START, RULES) == {
            "ok": True, "message_id": "r"}
        assert (await store.find("r", START)).status == DONE
        assert await store.pull("beta", 1, self.LEASE, START, RULES) == []
        error = await _error(store.settle("r", transitions.cancel("alpha"), START, RULES))
        assert (error.status, error.code) == (404, "no_such_message")


def build_site(config: Config, clock: Clock, store=None):
    """The broker's production site over ``store`` (a memory store when None), built
    by the composition root (:func:`relay.broker.assembly.assemble`) without listeners."""
    from relay.broker.assembly import assemble
    from relay.store.memory import MemoryStore

    store = store if store is not None else MemoryStore()
    return assemble(config, store, clock, listen=False).site


TEAM_RULES = make_rules(max_attempts=3, roles={
    "triage": delivery.Role(frozenset({"dan", "erin"}), self_join=True),
    "audit": delivery.Role(frozenset({"erin"}), self_join=False),
})


class TeamContract(_Contract):
    """REACH §13 roles and §14 priorities as a store keeps them: a role's queue leased
    by competing members, each message once, only by its holder; pulls by priority,
    then in order; the v1.0 poll untouched."""

    async def send(self, store, sender="alpha", to="beta", now=START, **fields) -> Message:
        priority = fields.pop("priority", 0)
        message = new_message(sender, to, now, **fields)
        message.priority = priority
        assert await store.add(message, TEAM_RULES) is True
        return message

    def pull(self, store, agent: str, limit: int = 10, now: float = START, role=None):
        return store.pull(agent, limit, self.LEASE, now, TEAM_RULES, None, role)

    @pytest_twisted.ensureDeferred
    async def test_a_pull_leases_higher_priority_first_and_in_order_within_one(self, store):
        for message_id, priority in (("a", 0), ("b", 5), ("c", 0), ("d", 9), ("e", 5)):
            await self.send(store, id=message_id, priority=priority)
        assert [m.id for m in await self.pull(store, "beta", 2)] == ["d", "b"]
        assert [m.id for m in await self.pull(store, "beta", 10)] == ["e", "a", "c"]

    @pytest_twisted.ensureDeferred
    async def test_equal_priorities_keep_the_order_of_sending(self, store):
        for n in range(6):
            await self.send(store, id=f"m{n}", priority=3)
        assert [m.id for m in await self.pull(store, "beta", 10)] == [
            f"m{n}" for n in range(6)]

    @pytest_twisted.ensureDeferred
    async def test_the_v10_poll_stays_in_sequence_order(self, store):
        for message_id, priority in (("a", 0), ("b", 7), ("c", 2)):
            await self.send(store, id=message_id, priority=priority)
        messages, _ = await store.poll("beta", None, 10, START, TEAM_RULES)
        assert [m.id for m in messages] == ["a", "b", "c"]

    @pytest_twisted.ensureDeferred
    async def test_a_priority_is_kept_and_shown_only_above_zero(self, store):
        await self.send(store, id="urgent", priority=7)
        await self.send(store, id="plain")
        urgent, plain = await store.find("urgent", START), await store.find("plain", START)
        assert urgent.priority == 7 and urgent.envelope()["priority"] == 7
        assert json.loads(urgent.envelope_json())["priority"] == 7
        assert "priority" not in plain.envelope() and plain.priority == 0

    @pytest_twisted.ensureDeferred
    async def test_a_released_message_keeps_its_place_by_priority(self, store):
        await self.send(store, id="low", priority=1)
        await self.send(store, id="high", priority=8)
        (first,) = await self.pull(store, "beta", 1)
        assert first.id == "high"
        await ack(store, "high", "beta", first.lease_id, "release", None, START, TEAM_RULES)
        assert [m.id for m in await self.pull(store, "beta", 10)] == ["high", "low"]

    @pytest_twisted.ensureDeferred
    async def test_a_delayed_urgent_message_waits_for_its_delay(self, store):
        await self.send(store, id="plain")
        delayed = new_message("alpha", "beta", START, delay_seconds=30, id="later")
        delayed.priority = 9
        assert await store.add(delayed, TEAM_RULES) is True
        assert [m.id for m in await self.pull(store, "beta", 10)] == ["plain"]
        await store.release_due(START + 30, TEAM_RULES)
        assert [m.id for m in await self.pull(store, "beta", 10, START + 30)] == ["later"]

    # -- roles ---------------------------------------------------------------------

    @pytest_twisted.ensureDeferred
    async def test_competing_members_lease_a_role_message_once(self, store):
        await self.send(store, to="role:triage", id="t1")
        await self.send(store, to="role:triage", id="t2")
        dan = await self.pull(store, "dan", 1)
        erin = await self.pull(store, "erin", 5)
        assert [m.id for m in dan] == ["t1"] and [m.id for m in erin] == ["t2"]
        assert await self.pull(store, "dan") == [] and await self.pull(store, "erin") == []
        assert dan[0].to == "role:triage" and dan[0].holder == "dan"

    @pytest_twisted.ensureDeferred
    async def test_only_the_holder_renews_or_acks_a_role_message(self, store):
        await self.send(store, to="role:triage", id="t", kind="request")
        (leased,) = await self.pull(store, "dan")
        for agent in ("erin", "alpha", "role:triage"):
            e = await _error(ack(store, "t", agent, leased.lease_id, "completed", None,
                                 START, TEAM_RULES))
            assert (e.status, e.code) == (403, "forbidden")
            e = await _error(store.settle("t", delivery.renew(agent, leased.lease_id, 60),
                                          START, TEAM_RULES))
            assert (e.status, e.code) == (403, "forbidden")
        (entry,) = await store.status(["t"], "alpha", START, TEAM_RULES)
        assert entry["status"] == LEASED and entry["leasedBy"] == "dan"
        assert "completedBy" not in entry
        reply = {"id": "answer", "body": {"ok": 1}, "kind": "reply", "ack": False,
                 "priority": 4}
        transition = delivery.ack("dan", leased.lease_id, "completed", None, TEAM_RULES,
                                  reply=reply)
        assert (await store.settle("t", transition, START, TEAM_RULES))["replyId"] == "answer"
        (entry,) = await store.status(["t"], "alpha", START, TEAM_RULES)
        assert entry["status"] == DONE and entry["completedBy"] == "dan"
        assert "leasedBy" not in entry
        answer = await store.find("answer", START)
        assert (answer.sender, answer.to, answer.priority) == ("dan", "alpha", 4)
        # the holder sees the status of what it worked on; another member does not
        (own,) = await store.status(["t"], "dan", START, TEAM_RULES)
        assert own["completedBy"] == "dan"
        (other,) = await store.status(["t"], "erin", START, TEAM_RULES)
        assert other["status"] == "not_found"

    @pytest_twisted.ensureDeferred
    async def test_a_lapsed_role_lease_goes_back_to_the_role_queue(self, store):
        await self.send(store, to="role:triage", id="t")
        (first,) = await self.pull(store, "dan")
        later = START + self.LEASE
        (again,) = await self.pull(store, "erin", now=later)
        assert again.id == "t" and again.holder == "erin" and again.deliveries == 2
        e = await _error(ack(store, "t", "dan", first.lease_id, "completed", None, later,
                             TEAM_RULES))
        assert (e.status, e.code) == (403, "forbidden")
        await ack(store, "t", "erin", again.lease_id, "completed", None, later, TEAM_RULES)
        (entry,) = await store.status(["t"], "alpha", later, TEAM_RULES)
        assert entry["completedBy"] == "erin"

    @pytest_twisted.ensureDeferred
    async def test_a_pull_ranks_the_own_queue_and_the_roles_together(self, store):
        await self.send(store, to="erin", id="own-old")
        await self.send(store, to="role:audit", id="audit", priority=2)
        await self.send(store, to="role:triage", id="triage-old")
        await self.send(store, to="erin", id="own-urgent", priority=6)
        assert [m.id for m in await self.pull(store, "erin")] == [
            "own-urgent", "audit", "own-old", "triage-old"]

    @pytest_twisted.ensureDeferred
    async def test_a_pull_narrowed_to_a_role(self, store):
        await self.send(store, to="erin", id="own")
        await self.send(store, to="role:audit", id="audit")
        await self.send(store, to="role:triage", id="triage")
        assert [m.id for m in await self.pull(store, "erin", role="triage")] == ["triage"]
        e = await _error(self.pull(store, "dan", role="audit"))
        assert (e.status, e.code) == (403, "forbidden")
        e = await _error(self.pull(store, "dan", role="nobody"))
        assert (e.status, e.code) == (404, "no_such_agent")
        assert [m.id for m in await self.pull(store, "erin")] == ["own", "audit"]

    @pytest_twisted.ensureDeferred
    async def test_the_v10_poll_never_returns_a_role_message(self, store):
        await self.send(store, to="role:triage", id="t")
        for member in ("dan", "erin"):
            messages, _ = await store.poll(member, None, 10, START, TEAM_RULES)
            assert messages == []
        assert await store.recent("dan", 10, START, TEAM_RULES) == []

    @pytest_twisted.ensureDeferred
    async def test_a_card_joins_an_open_role(self, store):
        await self.send(store, to="role:triage", id="t1")
        await store.register("zed", int(START), {"roles": ["triage"]})
        assert [m.id for m in await self.pull(store, "zed")] == ["t1"]
        # a card listing a closed role gives nothing of it (the broker refuses it first)
        await self.send(store, to="role:audit", id="a1")
        await store.register("yan", int(START), {"roles": ["audit"]})
        assert await self.pull(store, "yan") == []
        await store.register("zed", int(START), {"description": "left"})
        await self.send(store, to="role:triage", id="t2")
        assert await self.pull(store, "zed") == []

    @pytest_twisted.ensureDeferred
    async def test_every_member_is_told_of_a_role_message(self, store):
        await store.register("zed", int(START), {"roles": ["triage"]})
        await self.send(store, to="role:triage", id="t", priority=3)
        for member in ("dan", "erin", "zed"):
            page = await store.events(member, 0, 10)
            assert [(e.type, json.loads(e.data)) for e in page.events] == [
                ("message", {"id": "t", "from": "alpha", "to": "role:triage",
                             "kind": "message", "rootId": None, "parentId": None,
                             "priority": 3})]
        assert (await store.events("role:triage", 0, 10)).events == []
        (leased,) = await self.pull(store, "zed")
        page = await store.events("alpha", 0, 10)
        assert [e.type for e in page.events] == ["status"]
        assert json.loads(page.events[0].data)["status"] == LEASED

    @pytest_twisted.ensureDeferred
    async def test_a_role_queue_has_its_depth(self, store):
        await self.send(store, to="role:triage", id="t1")
        await self.send(store, to="role:triage", id="t2")
        await self.pull(store, "dan", 1)
        depths = {d.agent: d for d in await store.queue_depths(START)}
        assert (depths["role:triage"].queued, depths["role:triage"].leased) == (1, 1)

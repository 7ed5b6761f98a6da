"""GET /v1/events through the real ``twistd -n relay`` process: order, limits, and
resuming without loss or repeat across a restart and a SIGKILL; and two brokers on
one PostgreSQL database serving one ordered stream per agent (needs
``RELAY_TEST_POSTGRES_DSN``)."""

from __future__ import annotations

import os
from typing import Any, List

import pytest

from tests.conftest import reset_postgres
from tests.support.processes import BrokerProcess, EventReader

ALPHA, BETA = "alpha", "beta"


def started(tmp_path, **broker: Any) -> BrokerProcess:
    return BrokerProcess(str(tmp_path), **broker).start()


def register(broker: BrokerProcess, *agents: str) -> None:
    for agent in agents:
        assert broker.request(agent, "POST", "/register", {})[0] == 200


def send(broker: BrokerProcess, n: int, to: str = BETA) -> List[str]:
    ids = []
    for i in range(n):
        status, answer = broker.request(ALPHA, "POST", "/messages",
                                        {"to": to, "body": {"secret": f"body-{i}"}})
        assert status == 201
        ids.append(answer["id"])
    return ids


@pytest.mark.process
def test_events_arrive_in_order_without_bodies_and_statuses_reach_the_sender(tmp_path):
    broker = started(tmp_path, storage="sqlite")
    try:
        register(broker, ALPHA, BETA)
        beta, alpha = EventReader(broker, BETA), EventReader(broker, ALPHA)
        assert beta.status == 200
        assert beta.response.getheader("content-type") == "text/event-stream"
        ids = send(broker, 3)
        got = beta.take(3)
        assert [(r["event"], r["data"]["id"]) for r in got] == [("message", i) for i in ids]
        assert [int(r["id"]) for r in got] == sorted(int(r["id"]) for r in got)
        assert "body-" not in repr(got)
        status, pulled = broker.request(BETA, "POST", "/v1/pull", {"limit": 1})
        (message,) = pulled["messages"]
        broker.request(BETA, "POST", "/v1/ack", {"messageId": message["id"],
                                                 "leaseId": message["leaseId"],
                                                 "outcome": "completed"})
        assert [(r["event"], r["data"]["status"]) for r in alpha.take(2)] == [
            ("status", "leased"), ("status", "done")]
        beta.close()
        alpha.close()
    finally:
        broker.kill()


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
@pytest.mark.parametrize("how", ["restart", "sigkill"])
@pytest.mark.process
def test_resume_after_a_restart_or_sigkill_gives_exactly_what_followed(tmp_path, storage,
                                                                      how):
    broker = started(tmp_path, storage=storage)
    try:
        register(broker, ALPHA, BETA)
        stream = EventReader(broker, BETA)
        first = send(broker, 3)
        seen = stream.take(3)
        assert [r["data"]["id"] for r in seen] == first
        stream.close()
        missed = send(broker, 2)  # while no stream is open
        if how == "restart":
            assert broker.stop() in (0, -15)
        else:
            broker.kill()
        broker.start()
        after = send(broker, 2)
        resumed = EventReader(broker, BETA, since=seen[1]["id"])
        got = resumed.take(5)
        assert [r["data"]["id"] for r in got] == first[2:] + missed + after
        assert len({r["id"] for r in got}) == 5 and int(got[0]["id"]) > int(seen[1]["id"])
        resumed.close()
        by_header = EventReader(broker, BETA, last_event_id=got[-2]["id"])
        assert by_header.next()["data"]["id"] == after[-1]
        by_header.close()
    finally:
        broker.kill()


@pytest.mark.process
def test_the_stream_limits_of_a_process(tmp_path):
    broker = started(tmp_path, maxStreamsPerAgent=1, maxStreams=2)
    try:
        register(broker, ALPHA, BETA, "gamma")
        older = EventReader(broker, BETA)
        older.next(keepalives=True)
        newer = EventReader(broker, BETA)
        assert older.next() is None, "the agent's oldest stream is closed"
        other = EventReader(broker, "gamma")
        refused = EventReader(broker, ALPHA)
        assert refused.status == 503 and refused.error["error"]["code"] == "busy"
        send(broker, 1)
        assert newer.next()["event"] == "message"
        for reader in (newer, other, refused):
            reader.close()
    finally:
        broker.kill()


@pytest.fixture
def pair(tmp_path):
    dsn = reset_postgres()  # skips without RELAY_TEST_POSTGRES_DSN
    values = dict(storage="postgres", postgres={"dsn": dsn, "poolSize": 4})
    brokers = []
    try:
        for name in ("a", "b"):
            os.makedirs(tmp_path / name)
            brokers.append(BrokerProcess(str(tmp_path / name), **values).start())
        yield brokers
    finally:
        for broker in brokers:
            broker.kill()


@pytest.mark.postgres
@pytest.mark.process
def test_an_event_caused_on_a_arrives_on_a_stream_held_on_b_in_order(pair):
    a, b = pair
    register(a, ALPHA, BETA)
    stream = EventReader(b, BETA)
    ids = []
    for i in range(10):  # sends through both brokers, alternately
        ids += send(a if i % 2 == 0 else b, 1)
    got = stream.take(10)
    assert [r["data"]["id"] for r in got] == ids
    assert [int(r["id"]) for r in got] == sorted(int(r["id"]) for r in got)
    stream.close()
    # a stream resumed on A gives what followed, whichever broker recorded it
    more = send(b, 2)
    resumed = EventReader(a, BETA, since=got[4]["id"])
    assert [r["data"]["id"] for r in resumed.take(7)] == ids[5:] + more
    resumed.close()

"""Groups (REACH §13) through the real ``twistd -n relay`` process: copies and the
sent id's status survive a SIGKILL on sqlite and jsonl, a SIGHUP reload changes who
gets a copy, each copy's webhook fires, and two brokers on one PostgreSQL give the
same copies for the same sent id."""

from __future__ import annotations

import json
import signal
import time
from typing import Any, Dict, List

import pytest
import yaml

from tests.processes.test_webhooks import Receiver
from tests.support.processes import BrokerProcess

SECRETS = {name: f"{name}-own-secret-0123456789" for name in ("alice", "bob", "carol", "dan")}


def write_config(broker: BrokerProcess, members: List[str]) -> None:
    with open(broker.config_path) as f:
        config = yaml.safe_load(f)
    config["agents"] = {name: {"secret": secret} for name, secret in SECRETS.items()}
    config["groups"] = {"reviewers": {"members": members}}
    with open(broker.config_path, "w") as f:
        yaml.safe_dump(config, f)


def call(broker: BrokerProcess, agent: str, method: str, path: str, body: Any = None):
    broker.secret = SECRETS[agent]
    return broker.request(agent, method, path, body)


def group_send(broker: BrokerProcess, sent_id: str) -> tuple:
    return call(broker, "alice", "POST", "/messages",
                {"to": "group:reviewers", "id": sent_id, "kind": "request",
                 "body": {"text": "review"}})


def status_of(broker: BrokerProcess, sent_id: str) -> Dict[str, Any]:
    status, answer = call(broker, "alice", "POST", "/v1/status", {"messageIds": [sent_id]})
    assert status == 200
    return answer["messages"][0]


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
@pytest.mark.process
def test_copies_and_the_sent_status_survive_a_sigkill(tmp_path, storage):
    broker = BrokerProcess(str(tmp_path), storage=storage)
    write_config(broker, ["alice", "bob", "carol"])
    broker.start()
    try:
        status, sent = group_send(broker, "g1")
        assert status == 201, sent
        status, answer = call(broker, "bob", "POST", "/v1/pull", {})
        (leased,) = answer["messages"]
        broker.kill()
        broker.start()
        assert group_send(broker, "g1") == (200, dict(sent, duplicate=True))
        assert status_of(broker, "g1") == {"id": "g1", "via": "group:reviewers", "copies": [
            dict(sent["copies"][0], status="leased"), dict(sent["copies"][1], status="queued")]}
        # the lease taken before the kill still acks; carol's copy is still hers
        assert call(broker, "bob", "POST", "/v1/ack",
                    {"messageId": leased["id"], "leaseId": leased["leaseId"],
                     "outcome": "completed"})[0] == 200
        (copy,) = call(broker, "carol", "POST", "/v1/pull", {})[1]["messages"]
        assert (copy["id"], copy["via"], copy["rootId"]) == (
            sent["copies"][1]["id"], "group:reviewers", "g1")
    finally:
        broker.kill()


@pytest.mark.process
def test_a_reload_changes_the_members_that_get_a_copy(tmp_path):
    broker = BrokerProcess(str(tmp_path), storage="memory")
    write_config(broker, ["bob", "carol"])
    broker.start()
    try:
        assert [c["to"] for c in group_send(broker, "before")[1]["copies"]] == ["bob", "carol"]
        write_config(broker, ["carol", "dan"])
        broker.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            groups = call(broker, "alice", "GET", "/peers")[1].get("groups")
            if groups == [{"name": "reviewers", "members": ["carol", "dan"]}]:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the reload did not apply: {broker.log()}")
        assert [c["to"] for c in group_send(broker, "after")[1]["copies"]] == ["carol", "dan"]
        # a send made before keeps its copies
        assert [c["to"] for c in status_of(broker, "before")["copies"]] == ["bob", "carol"]
        # a reload with a bad group is refused whole, naming the key; the old one stays
        with open(broker.config_path) as f:
            config = yaml.safe_load(f)
        config["groups"]["reviewers"]["members"] = ["carol", "nobody"]
        with open(broker.config_path, "w") as f:
            yaml.safe_dump(config, f)
        broker.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "groups.reviewers.members" not in broker.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "groups.reviewers.members" in broker.log()
        assert [c["to"] for c in group_send(broker, "later")[1]["copies"]] == ["carol", "dan"]
    finally:
        broker.kill()


@pytest.mark.process
def test_a_bad_group_stops_the_start_with_the_key_and_the_reason(tmp_path):
    broker = BrokerProcess(str(tmp_path), storage="memory")
    write_config(broker, ["bob", "nobody"])
    code, output = broker.exit_status()
    assert code != 0
    assert "groups.reviewers.members" in output and "'nobody' is not an agent" in output


@pytest.mark.process
def test_each_copy_fires_its_members_webhook(tmp_path):
    receiver = Receiver()
    broker = BrokerProcess(str(tmp_path), storage="memory")
    write_config(broker, ["alice", "bob", "carol"])
    broker.start()
    try:
        url = f"http://127.0.0.1:{receiver.port}/"
        for member in ("bob", "carol"):
            assert call(broker, member, "POST", "/register",
                        {"webhook": {"url": url + member}})[0] == 200
        sent = group_send(broker, "g1")[1]
        got = receiver.wait_for(2)
        seen = sorted((g["path"], json.loads(g["raw"])["data"]["id"]) for g in got)
        assert seen == [("/" + c["to"], c["id"]) for c in sent["copies"]]
    finally:
        broker.kill()
        receiver.close()


@pytest.mark.postgres
@pytest.mark.process
def test_two_brokers_on_one_postgres_give_the_same_copies(tmp_path):
    from tests.conftest import reset_postgres

    dsn = reset_postgres()  # skips without RELAY_TEST_POSTGRES_DSN
    brokers = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            process = BrokerProcess(str(tmp_path / name), storage="postgres",
                                    postgres={"dsn": dsn, "poolSize": 4})
            write_config(process, ["alice", "bob", "carol", "dan"])
            brokers.append(process.start())
        a, b = brokers
        first = group_send(a, "g1")
        assert first[0] == 201
        assert group_send(b, "g1") == (200, dict(first[1], duplicate=True))
        assert status_of(b, "g1") == status_of(a, "g1")
        # the same new id sent to both at once: one stores, the other answers the same
        from concurrent.futures import ThreadPoolExecutor

        for i in range(5):
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(group_send, brokers, [f"race-{i}"] * 2))
            assert sorted(code for code, _ in answers) == [200, 201], answers
            assert answers[0][1]["copies"] == answers[1][1]["copies"]
            assert len(answers[0][1]["copies"]) == 3
        for member in ("bob", "carol", "dan"):
            pulled = call(b, member, "POST", "/v1/pull", {"limit": 100})[1]["messages"]
            assert len(pulled) == 6, "one copy of each send, however often it was sent"
    finally:
        for broker in brokers:
            broker.kill()

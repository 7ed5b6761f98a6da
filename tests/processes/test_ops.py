"""The real ``twistd -n relay`` with an ops listener: health, metrics and the JSON API
over TCP, and SIGHUP reloading secrets without dropping a waiting long-poll."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Tuple

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import BrokerProcess, free_port

pytestmark = pytest.mark.process

TOKEN = "process-ops-token"


class OpsBroker(BrokerProcess):
    def __init__(self, directory: str, **broker: Any) -> None:
        self.ops_port = free_port()
        broker.setdefault("opsListen", [f"tcp:{self.ops_port}:interface=127.0.0.1"])
        broker.setdefault("opsToken", TOKEN)
        super().__init__(directory, **broker)

    def ops(self, path: str, token: str = TOKEN, timeout: float = 10.0) -> Tuple[int, bytes]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.ops_port}{path}",
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def rewrite(self, **broker: Any) -> None:
        with open(self.config_path) as f:
            config = yaml.safe_load(f)
        config["broker"].update(broker)
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)

    def wait_for_log(self, text: str, count: int = 1, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log().count(text) >= count:
                return
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in the log: {self.log()}")


def samples(text: bytes) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode("utf-8")):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.fixture
def broker(tmp_path):
    b = OpsBroker(str(tmp_path)).start()
    yield b
    b.stop()


def test_health_metrics_and_overview_over_tcp(broker):
    code, body = broker.ops("/healthz", token="")
    assert code == 200 and json.loads(body)["ok"] is True
    assert broker.ops("/metrics", token="wrong")[0] == 401
    assert broker.request("beta", "POST", "/register", {})[0] == 200
    assert broker.request("alpha", "POST", "/messages", {"to": "beta", "id": "p1"})[0] == 201
    code, text = broker.ops("/metrics")
    assert code == 200
    found = samples(text)
    assert found["relay_messages_sent_total", ()] == 1
    assert found["relay_http_requests_total", (("code", "201"), ("route", "send"))] == 1
    assert found["relay_http_request_duration_seconds_count", (("route", "send"),)] == 1
    assert found["relay_queue_messages", (("agent", "beta"), ("state", "queued"))] == 1
    assert found["relay_store_commit_seconds_count", ()] == 0  # the memory store commits nothing
    assert ("process_resident_memory_bytes", ()) in found
    code, body = broker.ops("/api/overview")
    assert code == 200 and json.loads(body)["agents"][0]["agent"] == "beta"
    # the main listener serves none of it
    assert broker.request("alpha", "GET", "/metrics")[0] == 404


def test_sighup_rotates_the_secret_without_dropping_a_long_poll(broker):
    assert broker.request("beta", "POST", "/register", {})[0] == 200
    answers: List[Tuple[int, Any]] = []
    started = time.monotonic()
    poll = threading.Thread(target=lambda: answers.append(
        broker.request("beta", "POST", "/v1/pull", {"waitSeconds": 4}, timeout=15)))
    poll.start()
    time.sleep(0.5)
    old = broker.secret
    broker.rewrite(secret=["rotated-secret-0123456789", old])
    broker.proc.send_signal(signal.SIGHUP)
    broker.wait_for_log("config reloaded")
    broker.secret = "rotated-secret-0123456789"
    assert broker.request("alpha", "POST", "/messages", {"to": "gamma"})[0] == 404  # signed ok
    broker.secret = old
    assert broker.request("beta", "POST", "/register", {})[0] == 200  # the old one still works
    poll.join(15)
    assert answers and answers[0][0] == 200
    assert time.monotonic() - started >= 3.5, "the long poll ran to its deadline"

    broker.rewrite(secret=["rotated-secret-0123456789"])
    broker.proc.send_signal(signal.SIGHUP)
    broker.wait_for_log("config reloaded", count=2)
    assert broker.request("beta", "POST", "/register", {})[0] == 401
    broker.secret = "rotated-secret-0123456789"
    assert broker.request("beta", "POST", "/register", {})[0] == 200


def test_sighup_with_a_broken_config_keeps_the_running_one(broker):
    broker.rewrite(leaseSeconds="long")
    broker.proc.send_signal(signal.SIGHUP)
    broker.wait_for_log("config reload refused")
    refusals = [line for line in broker.log().splitlines() if "reload refused" in line]
    assert len(refusals) == 1 and "broker.leaseSeconds" in refusals[0]
    assert broker.request("beta", "POST", "/register", {})[0] == 200
    assert broker.proc.poll() is None

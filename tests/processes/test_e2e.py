"""End to end: the real ``twistd -n relay`` process over a real socket."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import broker_storage
from tests.support.processes import TWISTD, BrokerProcess

pytestmark = pytest.mark.process


@pytest.fixture
def broker(tmp_path):
    b = BrokerProcess(str(tmp_path)).start()
    yield b
    b.kill()


@pytest.mark.parametrize("storage", ["memory", "postgres"])
def test_message_round_trip(tmp_path, storage):
    broker = BrokerProcess(str(tmp_path), **broker_storage(storage)).start()
    try:
        round_trip(broker, storage)
    finally:
        broker.kill()


def round_trip(broker: BrokerProcess, storage: str) -> None:
    status, info = broker.request("alpha", "GET", "/")
    assert status == 200 and info["protocol"] == "1.0" and info["storage"] == storage
    assert broker.request("beta", "POST", "/register", {"agent": "beta"})[0] == 200
    status, sent = broker.request("alpha", "POST", "/messages",
                                  {"to": "beta", "body": {"text": "hi"}, "kind": "request"})
    assert status == 201 and sent["duplicate"] is False
    status, pulled = broker.request("beta", "POST", "/v1/pull", {"limit": 5})
    (message,) = pulled["messages"]
    assert message["id"] == sent["id"] and message["body"] == {"text": "hi"}
    status, acked = broker.request(
        "beta", "POST", "/v1/ack",
        {"messageId": message["id"], "leaseId": message["leaseId"], "outcome": "completed"},
    )
    assert acked == {"ok": True, "status": "done", "attempts": 0}
    status, states = broker.request("alpha", "POST", "/v1/status", {"messageIds": [sent["id"]]})
    assert states["messages"][0]["status"] == "done"
    # twistd re-raises the signal that stopped it once the shutdown is clean.
    assert broker.stop() in (0, -15)
    assert "Server Shut Down." in broker.log()


def test_config_error_stops_the_start_with_one_line(tmp_path):
    conf = tmp_path / "relay.yaml"
    conf.write_text("broker:\n  secret: s0123456789abcdef\n  leaseSeconds: 0\n")
    result = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "relay", "--config", str(conf)],
        capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
    )
    assert result.returncode == 78  # EX_CONFIG: systemd's RestartPreventExitStatus=78
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "relay: config error: broker.leaseSeconds: must be a number from 0.1 to 86400, not 0"
    ]


def test_a_port_in_use_stops_the_start_with_one_line(broker, tmp_path):
    conf = tmp_path / "second.yaml"
    conf.write_text(
        f"broker:\n  secret: s0123456789abcdef\n  storage: memory\n"
        f"  listen: ['tcp:{broker.port}:interface=127.0.0.1']\n"
    )
    result = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "relay", "--config", str(conf)],
        capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    # By then twistd has taken over stderr: the line reaches its log.
    output = result.stderr + result.stdout
    assert output.count("relay: cannot listen on") == 1
    assert f"relay: cannot listen on 127.0.0.1:{broker.port}: Address already in use" in output

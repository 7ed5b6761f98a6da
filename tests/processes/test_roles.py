"""Role leases and priorities survive a SIGKILL of the real broker on SQLite and
jsonl (REACH §16 Restarts): what the broker acknowledged is there after the restart."""

from __future__ import annotations

import pytest

from tests.support.processes import BrokerProcess

pytestmark = pytest.mark.process

SECTIONS = {"agents": {"alpha": {}, "dan": {}, "erin": {}},
            "roles": {"triage": {"members": ["dan", "erin"]}}}


@pytest.mark.parametrize("storage", ["sqlite", "jsonl"])
def test_role_leases_and_priorities_survive_sigkill(tmp_path, storage):
    broker = BrokerProcess(str(tmp_path), storage=storage, sections=SECTIONS).start()
    try:
        for message_id, priority in (("t-low", 0), ("t-high", 8), ("t-mid", 4), ("t-last", 0)):
            status, _ = broker.request("alpha", "POST", "/messages",
                                       {"to": "role:triage", "id": message_id,
                                        "priority": priority})
            assert status == 201
        status, pulled = broker.request("dan", "POST", "/v1/pull", {"limit": 1})
        assert status == 200
        (held,) = pulled["messages"]
        assert held["id"] == "t-high" and held["priority"] == 8
        broker.kill()  # SIGKILL
        broker.start()
        status, answer = broker.request("alpha", "POST", "/v1/status",
                                        {"messageIds": ["t-high"]})
        assert answer["messages"][0]["leasedBy"] == "dan"
        status, pulled = broker.request("erin", "POST", "/v1/pull", {"limit": 10})
        assert [m["id"] for m in pulled["messages"]] == ["t-mid", "t-low", "t-last"]
        assert [m.get("priority") for m in pulled["messages"]] == [4, None, None]
        ack = {"messageId": "t-high", "leaseId": held["leaseId"], "outcome": "completed"}
        assert broker.request("erin", "POST", "/v1/ack", ack)[0] == 403
        assert broker.request("dan", "POST", "/v1/ack", ack)[0] == 200
        broker.kill()
        broker.start()
        status, answer = broker.request("alpha", "POST", "/v1/status",
                                        {"messageIds": ["t-high", "t-mid"]})
        first, second = answer["messages"]
        assert first["completedBy"] == "dan"
        assert second["leasedBy"] == "erin"
    finally:
        broker.stop()

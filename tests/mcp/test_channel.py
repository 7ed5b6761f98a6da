"""``relay mcp``'s channel notices (:mod:`relay.mcp.channel`) against the in-memory
broker, time on a Clock: what a notice says, and a burst of messages told in one."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

from relay.mcp.channel import BURST_SECONDS, MAX_NAMED, ChannelFollower, burst_notice
from tests.support.client import Net


def following(**broker: Any) -> Tuple[Net, Any, ChannelFollower, List[Tuple[str, Dict[str, str]]]]:
    net = Net(**broker)
    alpha, beta = net.client("alpha"), net.client("beta")
    net.run(alpha.register())
    net.run(beta.register())
    notices: List[Tuple[str, Dict[str, str]]] = []
    follower = ChannelFollower(beta, lambda content, meta: notices.append((content, meta)),
                               clock=net.clock)
    net.run(beta.handshake())
    follower.start()
    net.settle()
    return net, alpha, follower, notices


def send(net: Net, alpha: Any, kind: str = "message") -> str:
    if kind == "request":
        return net.run(alpha.send("beta", {"text": "the body, never told"}, kind="request"))["id"]
    return net.run(alpha.send("beta", {"text": "the body, never told"}))["id"]


def test_the_first_message_is_told_at_once_and_a_burst_after_it_in_one_notice():
    net, alpha, follower, notices = following()
    first = send(net, alpha)
    net.settle()
    assert len(notices) == 1, "the first one wakes the model at once"
    content, meta = notices[0]
    assert meta == {"event": "message", "kind": "message"}
    assert json.loads(content)["untrusted"] == {"from": "alpha", "id": first}
    burst = [send(net, alpha) for _ in range(30)] + [send(net, alpha, "request")]
    net.settle()
    assert len(notices) == 1, "the rest of the second is gathered"
    net.settle(BURST_SECONDS)
    assert len(notices) == 2
    content, meta = notices[1]
    document = json.loads(content)
    assert meta == {"event": "message", "count": "31"}
    assert document["count"] == 31 and document["kinds"] == {"message": 30, "request": 1}
    assert [m["untrusted"]["id"] for m in document["messages"]] == burst[:MAX_NAMED]
    assert all(m["untrusted"]["from"] == "alpha" for m in document["messages"])
    assert document["unnamed"] == 31 - MAX_NAMED
    assert "relay_reply" in document["next"] and "never instructions" in document["next"]
    assert "the body" not in "".join(c for c, _ in notices)
    # a quiet second later, the next message is told at once again
    net.settle(BURST_SECONDS)
    send(net, alpha)
    net.settle()
    assert len(notices) == 3 and json.loads(notices[2][0])["kind"] == "message"
    follower.stop()
    net.settle()


def test_a_steady_flow_is_told_once_a_second():
    net, alpha, follower, notices = following()
    for _ in range(50):  # ten messages a second for five seconds
        send(net, alpha)
        net.settle(0.1)
    net.settle(BURST_SECONDS)
    assert 5 <= len(notices) <= 7
    counts = [int(meta.get("count", "1")) for _, meta in notices]
    assert sum(counts) == 50, "every message is counted once"
    follower.stop()
    net.settle()


def test_one_message_of_a_burst_is_told_as_one_message():
    content, meta = burst_notice([{"id": "m1", "from": "a", "kind": "reply"}])
    assert meta == {"event": "message", "kind": "reply"}
    assert "relay_wait_reply" in json.loads(content)["next"]


def test_names_chosen_by_other_agents_stay_out_of_meta():
    content, meta = burst_notice([{"id": "m1", "from": "x\" onclick=", "kind": "<b>"},
                                  {"id": "m2", "from": "y", "kind": "request"}])
    assert meta == {"event": "message", "count": "2"}
    document = json.loads(content)
    assert document["kinds"] == {"message": 1, "request": 1}, "an unknown kind is a message"
    assert document["messages"][0]["untrusted"] == {"from": "x\" onclick=", "id": "m1"}


def test_a_reset_tells_the_burst_first_then_that_messages_may_wait():
    net, alpha, follower, notices = following()
    send(net, alpha)
    send(net, alpha)
    net.settle()
    follower.reset()
    assert [meta["event"] for _, meta in notices] == ["message", "message", "reset"]
    follower.stop()
    net.settle()


def test_stopping_drops_the_burst_and_its_timer():
    net, alpha, follower, notices = following()
    send(net, alpha)
    send(net, alpha)
    net.settle()
    follower.stop()
    net.settle(BURST_SECONDS * 3)
    assert len(notices) == 1
    assert not net.clock.getDelayedCalls()

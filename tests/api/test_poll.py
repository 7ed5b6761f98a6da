"""``GET /messages``, the v1.0 poll: the cursor and the limit (seed §4), the once-only
recovery delivery of an expired lease (§5.1), the long poll, and what it never returns
(role messages, REACH §13).

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from tests.support.api import assert_error, assert_json_headers, two_agents

# -- v1.0: cursor and limit (seed §4) ------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_poll_cursor_semantics():
    b = await two_agents()
    await b.register("gamma")
    ids = [await b.message("alpha", "beta", id=f"m{i}") for i in range(5)]
    await b.message("alpha", "gamma", id="other")
    messages, cursor = await b.poll("beta", "?limit=2")
    assert [m["id"] for m in messages] == ids[:2] and cursor == ids[1]
    messages, cursor = await b.poll("beta", f"?since={cursor}")
    assert [m["id"] for m in messages] == ids[2:] and cursor == ids[4]
    messages, cursor = await b.poll("beta", f"?since={cursor}&limit=50")
    assert messages == [] and cursor == ids[4], "an empty poll keeps the cursor"
    messages, _ = await b.poll("beta", "?since=unknown-id")
    assert [m["id"] for m in messages] == ids, "an unknown cursor returns everything"
    messages, _ = await b.poll("beta", "?since=other")
    assert [m["id"] for m in messages] == [], "ordering is global: other agents' ids count"


@pytest_twisted.ensureDeferred
async def test_poll_with_empty_since_as_the_reference_client_sends_it():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    await b.message("alpha", "beta", id="b")
    reply = await b.get("beta", "/messages?since=&limit=50")
    assert reply.code == 200
    assert_json_headers(reply)
    assert [m["id"] for m in reply.json["messages"]] == ["a", "b"]
    assert reply.json["cursor"] == "b"


@pytest_twisted.ensureDeferred
async def test_poll_with_nothing_returns_a_null_cursor():
    b = await two_agents()
    reply = await b.get("beta", "/messages?since=&limit=50")
    assert reply.json == {"messages": [], "cursor": None}
    reply = await b.get("beta", "/messages")
    assert reply.json == {"messages": [], "cursor": None}


@pytest_twisted.ensureDeferred
async def test_poll_returns_only_my_messages():
    b = await two_agents()
    await b.message("alpha", "beta", id="to-beta")
    await b.message("beta", "alpha", id="to-alpha")
    assert [m["id"] for m in (await b.poll("beta"))[0]] == ["to-beta"]
    assert [m["id"] for m in (await b.poll("alpha"))[0]] == ["to-alpha"]


@pytest_twisted.ensureDeferred
async def test_poll_cursor_with_percent_encoded_id():
    b = await two_agents()
    await b.message("alpha", "beta", id="a b&c")
    await b.message("alpha", "beta", id="next")
    messages, cursor = await b.poll("beta", "?since=a%20b%26c&limit=50")
    assert [m["id"] for m in messages] == ["next"] and cursor == "next"


@pytest.mark.parametrize(
    ("limit", "expected"),
    [("1", 1), ("0", 1), ("-5", 1), ("2.9", 2), ("199", 199), ("200", 200), ("201", 200),
     ("100000", 200), ("abc", 50), ("", 50), ("NaN", 50), ("Infinity", 50), (None, 50)],
)
@pytest_twisted.ensureDeferred
async def test_poll_limit_is_clamped(limit, expected):
    b = await two_agents()
    for i in range(205):
        await b.message("alpha", "beta", id=f"m{i:03d}")
    query = "" if limit is None else f"?limit={limit}"
    messages, cursor = await b.poll("beta", query)
    assert len(messages) == expected
    assert cursor == f"m{expected - 1:03d}"


# -- v1.1: recovery delivery and the long poll (seed §5.1) ---------------------------------


@pytest_twisted.ensureDeferred
async def test_recovery_delivery_after_lease_expiry():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    await b.message("alpha", "beta", id="b")
    (leased,) = await b.pull("beta", limit=1, leaseSeconds=60)
    assert leased["id"] == "a"
    messages, cursor = await b.poll("beta", "?since=&limit=50")
    assert [m["id"] for m in messages] == ["b"] and cursor == "b"
    b.clock.advance(60)
    messages, cursor2 = await b.poll("beta", f"?since={cursor}&limit=50")
    assert [m["id"] for m in messages] == ["a"], "the expired lease is delivered once"
    assert messages[0]["status"] == "queued"
    assert cursor2 == "b", "the cursor never moves backwards"
    messages, cursor3 = await b.poll("beta", f"?since={cursor2}&limit=50")
    assert messages == [] and cursor3 == "b"


@pytest_twisted.ensureDeferred
async def test_no_recovery_when_the_cursor_has_not_passed():
    b = await two_agents()
    await b.message("alpha", "beta", id="a")
    await b.pull("beta", leaseSeconds=60)
    b.clock.advance(60)
    messages, cursor = await b.poll("beta", "?since=&limit=50")
    assert [m["id"] for m in messages] == ["a"] and cursor == "a"
    messages, _ = await b.poll("beta", "?since=a&limit=50")
    assert messages == []


@pytest.mark.parametrize("wait", ["-1", "21", "x", "1.5"])
@pytest_twisted.ensureDeferred
async def test_poll_wait_out_of_range_is_400(wait):
    b = await two_agents()
    assert_error(await b.get("beta", f"/messages?wait={wait}"), 400, "bad_request")


@pytest_twisted.ensureDeferred
async def test_v10_long_poll_wakes_on_send():
    b = await two_agents()
    d = b.get("beta", "/messages?since=&limit=50&wait=20")
    b.advance(1)
    assert not d.called
    msg_id = await b.message("alpha", "beta")
    b.flush()
    assert [m["id"] for m in d.result.json["messages"]] == [msg_id]
    assert d.result.json["cursor"] == msg_id


# -- v1.3: never a role message (REACH §13) ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_v10_poll_never_returns_a_role_message(role_broker):
    await role_broker.register("dan")
    await role_broker.message("alpha", "role:triage", id="t")
    assert (await role_broker.poll("dan"))[0] == []
    assert_error(await role_broker.post("dan", "/messages/t/ack", {}), 403, "forbidden")

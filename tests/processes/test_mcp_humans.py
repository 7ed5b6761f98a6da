"""``relay_ask_human`` (REACH §15) through ``relay mcp`` and the SDK's own client:
the question reaches the person as a request whose body the inbox page shows as
buttons, and their answer (given here through the wire, as the page gives it)
comes back to the model; ``relay_wait_reply`` continues a wait that ran out.

The page itself answering is tests/processes/browser_inbox.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from typing import Any, Dict, Iterator, Optional

import pytest

from tests.processes.test_mcp import open_session, run, sdk, stderr_of  # noqa: F401 (sdk: a fixture)
from tests.support.processes import BrokerProcess

ALICE = "alice-secret-0123456789"
DANA = "dana-secret-0123456789"

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[BrokerProcess]:
    directory = tmp_path_factory.mktemp("mcp-humans")
    b = BrokerProcess(str(directory), agents={"alice": {"secret": ALICE},
                                              "dana": {"secret": DANA, "human": True}})
    b.start()
    secret = directory / "agent.secret"
    secret.write_text(ALICE + "\n")
    secret.chmod(0o600)
    b.secret_file = str(secret)  # type: ignore[attr-defined]
    assert b.request("dana", "POST", "/register", {})[0] == 200
    yield b
    b.kill()


def take_request(broker: BrokerProcess, timeout: float = 15.0) -> Dict[str, Any]:
    """What the person's page does: lease the request addressed to them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, pulled = broker.request("dana", "POST", "/v1/pull",
                                      {"limit": 1, "leaseSeconds": 300, "waitSeconds": 2})
        assert code == 200
        if pulled["messages"]:
            return pulled["messages"][0]
    raise AssertionError("no request reached the person")


def answer(broker: BrokerProcess, message: Dict[str, Any], text: Optional[str] = None,
           reject: Optional[str] = None) -> None:
    """The page's answer (a reply in the ack) or its reject with a reason."""
    ack: Dict[str, Any] = {"messageId": message["id"], "leaseId": message["leaseId"]}
    if reject is not None:
        ack.update(outcome="reject", error=reject)
    else:
        ack.update(outcome="completed", reply={"body": {"answer": text}})
    code, body = broker.request("dana", "POST", "/v1/ack", ack)
    assert code == 200, body


def test_a_person_answers_the_question_of_a_model(broker) -> None:
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            alice = await open_session(stack, broker, "alice")
            listed = {tool.name: tool for tool in (await alice.client.list_tools()).tools}
            schema = listed["relay_ask_human"].input_schema
            assert schema["required"] == ["to", "question"]
            assert set(schema["properties"]) == {"to", "question", "options", "wait_seconds"}
            assert "relay_wait_reply" in listed["relay_ask_human"].description

            peers = (await alice.call("relay_peers"))["peers"]
            (dana,) = [p for p in peers if p["untrusted"]["agent"] == "dana"]
            assert dana["human"] is True
            assert not any(p.get("human") for p in peers if p is not dana)

            # The person picks an option while the model waits.
            async def person_picks() -> Dict[str, Any]:
                message = await asyncio.to_thread(take_request, broker)
                await asyncio.to_thread(answer, broker, message, "ship it")
                return message

            asked, message = await asyncio.gather(
                alice.call("relay_ask_human", to="dana", question="Ship release 2.1 today?",
                           options=["ship it", "wait a day"], wait_seconds=15),
                person_picks(),
            )
            assert message["kind"] == "request" and message["from"] == "alice"
            assert message["body"] == {"question": "Ship release 2.1 today?",
                                       "options": ["ship it", "wait a day"]}
            assert asked["answered"] is True and asked["request_id"] == message["id"]
            assert asked["untrusted"] == {"from": "dana", "body": {"answer": "ship it"}}

            # A person takes time: the wait runs out, relay_wait_reply goes on, and
            # the person writes their own answer instead of an option.
            late = await alice.call("relay_ask_human", to="dana", question="Which branch?",
                                    wait_seconds=0)
            assert late["answered"] is False and "failed" not in late
            message = await asyncio.to_thread(take_request, broker)
            assert message["body"] == {"question": "Which branch?"}
            await asyncio.to_thread(answer, broker, message, "release/2.1, not main")
            waited = await alice.call("relay_wait_reply", request_id=late["request_id"],
                                      wait_seconds=10)
            assert waited["answered"] is True
            assert waited["untrusted"]["body"] == {"answer": "release/2.1, not main"}

            # The person rejects with a reason: a failure with their reason, no error.
            async def person_rejects() -> None:
                message = await asyncio.to_thread(take_request, broker)
                await asyncio.to_thread(answer, broker, message, None, "not my call: ask ops")

            refused, _ = await asyncio.gather(
                alice.call("relay_ask_human", to="dana", question="Drop the table?",
                           options=["yes", "no"], wait_seconds=15),
                person_rejects(),
            )
            assert refused["answered"] is False and refused["failed"] is True
            assert refused["untrusted"]["error"] == "not my call: ask ops"

            # Questions the page could not show as such are refused before sending.
            for bad in ({"to": "dana", "question": ""},
                        {"to": "dana", "question": "q", "options": []},
                        {"to": "dana", "question": "q", "options": [str(i) for i in range(11)]},
                        {"to": "dana", "question": "q", "options": ["same", "same"]},
                        {"to": "dana", "question": "q", "options": [""]},
                        {"to": "dana", "question": "q", "options": "yes"}):
                refusal = json.loads(await alice.error("relay_ask_human", **bad))
                assert refusal["error"]["code"] == "bad_arguments", bad
            assert "no_such_agent" in await alice.error("relay_ask_human", to="nobody",
                                                        question="q")
            code, pulled = broker.request("dana", "POST", "/v1/pull", {})
            assert code == 200 and pulled["messages"] == []
        assert "Traceback" not in stderr_of(broker, "alice")

    run(scenario())

"""Request/reply: RelayClient.request asks, the agent runtime answers.

A worker agent runs in this process (relay.agent.AgentService with a plain
function as its handler); the asker sends it requests and waits for each
answer, or for the broker's failure notice, or until its timeout.

    DSH_RELAY_SECRET_FILE=conf/relay.secret .venv/bin/python docs/examples/request_reply.py
"""

import os
import tempfile
from pathlib import Path

from twisted.internet import defer, task

from relay.agent import AgentService, Reject
from relay.agent.receipts import ReceiptStore
from relay.client import RelayClient, RequestFailed, RequestTimeout
from relay.client.settings import resolve_settings


def answer(message):
    """The worker's handler: the returned text is the reply's {"text": ...}."""
    text = message["body"].get("text")
    if not text:
        raise Reject("a question needs a text")  # fails at once: no retries
    return f"you asked: {text}"


async def main(reactor):
    settings = resolve_settings({}, os.environ, Path.home())

    def client(agent):
        return RelayClient(settings.broker_url, agent, settings.secret, clock=reactor)

    worker_client, asker = client("example-worker"), client("example-asker")
    await worker_client.register()  # a request can only be sent to a registered agent
    await client("example-idle").register()  # registered, but nobody answers for it
    with tempfile.TemporaryDirectory() as home:
        receipts = ReceiptStore.for_agent("example-worker", Path(home), reactor)
        worker = AgentService(worker_client, answer, clock=reactor, receipts=receipts)
        worker.startService()
        try:
            reply = await asker.request("example-worker", {"text": "what time is it?"}, 30)
            print(f"answer: {reply['body']['text']}")

            try:
                await asker.request("example-worker", {}, timeout=30)
            except RequestFailed as failure:  # the broker's failure notice
                print(f"the request {failure.event}: {failure.error}")

            try:
                await asker.request("example-idle", {"text": "anyone?"}, timeout=2)
            except RequestTimeout as timeout:
                print(f"no answer within {timeout.timeout:g} s")
                # still queued for example-idle: withdraw it
                await asker.cancel(timeout.request_id, "nobody answered")
        finally:
            await worker.stopService()
            receipts.close()


task.react(lambda reactor: defer.ensureDeferred(main(reactor)))

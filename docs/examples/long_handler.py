"""A handler that runs longer than its lease, and one that asks to be retried later.

The agent runtime renews the lease of a running handler every third of its
length, so a two-second lease carries a handler of several seconds (or hours)
and the request is delivered once. A handler raises relay.agent.Retry to be
called again later, without holding its lease meanwhile.

    DSH_RELAY_SECRET_FILE=conf/relay.secret .venv/bin/python docs/examples/long_handler.py
"""

import os
import tempfile
from pathlib import Path

from twisted.internet import defer, task

from relay.agent import AgentService, Retry
from relay.agent.receipts import ReceiptStore
from relay.client import RelayClient
from relay.client.settings import resolve_settings

LEASE_SECONDS = 2
calls = []


async def main(reactor):
    settings = resolve_settings({}, os.environ, Path.home())

    def client(agent):
        return RelayClient(settings.broker_url, agent, settings.secret, clock=reactor)

    async def think(message):
        text = message["body"]["text"]
        calls.append(message["id"])
        if text == "upstream" and len(calls) == 1:
            raise Retry("the upstream service is busy", after=1)
        if text == "a long task":
            await task.deferLater(reactor, 2.5 * LEASE_SECONDS)  # longer than the lease
        return f"done with {text}"

    worker_client, asker = client("example-thinker"), client("example-waiter")
    await worker_client.register()
    with tempfile.TemporaryDirectory() as home:
        receipts = ReceiptStore.for_agent("example-thinker", Path(home), reactor)
        worker = AgentService(worker_client, think, clock=reactor, receipts=receipts,
                              lease_seconds=LEASE_SECONDS)
        worker.startService()
        try:
            for text in ("a long task", "upstream"):
                calls.clear()
                reply = await asker.request("example-thinker", {"text": text}, timeout=30)
                (entry,) = (await asker.status([reply["parentId"]]))["messages"]
                print(f"{reply['body']['text']}: delivered {entry['deliveries']}x, "
                      f"retried {entry['attempts']}x")
        finally:
            await worker.stopService()
            receipts.close()


task.react(lambda reactor: defer.ensureDeferred(main(reactor)))

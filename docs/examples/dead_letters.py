"""Dead letters: a request the worker rejects fails at once, its sender hears of
it, finds it among its failed messages, and puts it back in the queue once the
problem is fixed.

    DSH_RELAY_SECRET_FILE=conf/relay.secret .venv/bin/python docs/examples/dead_letters.py
"""

import os
import tempfile
from pathlib import Path

from twisted.internet import defer, task

from relay.agent import AgentService, Reject
from relay.agent.receipts import ReceiptStore
from relay.client import RelayClient, RequestFailed
from relay.client.settings import resolve_settings

stock = {}  # empty: the worker cannot answer yet


def count(message):
    item = message["body"]["item"]
    if item not in stock:
        raise Reject(f"unknown item {item}")  # no retry can help: fail now
    return {"item": item, "left": stock[item]}


async def main(reactor):
    settings = resolve_settings({}, os.environ, Path.home())

    def client(agent):
        return RelayClient(settings.broker_url, agent, settings.secret, clock=reactor)

    worker_client, shop = client("example-stock"), client("example-shop")
    await worker_client.register()
    with tempfile.TemporaryDirectory() as home:
        receipts = ReceiptStore.for_agent("example-stock", Path(home), reactor)
        worker = AgentService(worker_client, count, clock=reactor, receipts=receipts)
        worker.startService()
        try:
            try:
                await shop.request("example-stock", {"item": "lamp"}, timeout=30)
            except RequestFailed as failure:
                print(f"the request failed: {failure.error}")
                request_id = failure.request_id

            # The dead letters this agent sent: failed messages, with their error.
            dead = await shop.query(status="failed", box="sent", to="example-stock")
            ids = [m["id"] for m in dead["messages"]]
            (entry,) = (await shop.status([request_id]))["messages"]
            print(f"among the dead letters: {request_id in ids} ({entry['error']})")

            stock["lamp"] = 3  # the problem is fixed: put the request back
            await shop.requeue(request_id)
            reply = await shop.await_reply(request_id, timeout=30, to="example-stock")
            print(f"after the requeue: {reply['body']['left']} lamps left")
        finally:
            await worker.stopService()
            receipts.close()


task.react(lambda reactor: defer.ensureDeferred(main(reactor)))

"""RelayClient from start to finish: two agents, a v1.0 message with a receipt,
then a v1.1 request leased, answered and acknowledged.

Run it against a broker, e.g. the one `make run` starts, with its secret:

    DSH_RELAY_SECRET_FILE=conf/relay.secret .venv/bin/python docs/examples/relay_client.py

The broker URL and the secret come from the same places as for the `relay`
command (flags aside): DSH_RELAY_BROKER_URL, DSH_RELAY_SECRET(_FILE), then
~/.dsh-relay.json.
"""

import os
from pathlib import Path

from twisted.internet import defer, task

from relay.client import RelayClient
from relay.client.settings import resolve_settings


async def main(reactor):
    settings = resolve_settings({}, os.environ, Path.home())

    def client(agent):
        return RelayClient(settings.broker_url, agent, settings.secret, clock=reactor)

    alpha, beta = client("example-alpha"), client("example-beta")
    info = await alpha.handshake()  # refuses a broker speaking another protocol
    print(f"broker {info.get('broker')} {info.get('version')}, protocol {info['protocol']}")
    await alpha.register()
    await beta.register()

    # v1.0: send with a receipt requested, read the inbox, send the receipt.
    sent = await alpha.send("example-beta", {"text": "hi"}, ack=True)
    inbox = await beta.recv(limit=50)  # keeps beta.cursor for the next recv
    for message in inbox["messages"]:
        print(f"beta got {message['body']} from {message['from']}")
        if message.get("ack"):
            await beta.ack(message["id"], "ok")
    receipts = await alpha.recv()
    for message in receipts["messages"]:
        print(f"alpha got a receipt for its message: {message['replyTo'] == sent['id']}")

    # v1.1: a request is leased, answered with a reply, then acknowledged.
    request = await alpha.send("example-beta", {"text": "2 + 2?"}, kind="request")
    leased = await beta.pull(limit=10, lease_seconds=60, wait=5)
    for m in leased["messages"]:
        if m["id"] == request["id"]:
            await beta.send(
                m["from"], {"text": "4"}, kind="reply", reply_to=m["id"], parent_id=m["id"]
            )
        await beta.ack_outcome(m["id"], m["leaseId"], "completed")
    answers = await alpha.pull(limit=10, wait=5)
    for m in answers["messages"]:
        if m.get("parentId") == request["id"]:
            print(f"alpha got the reply {m['body']}")
        else:
            # recv does not change a message's status: the receipt alpha read
            # above is still queued, so pull leases it too (docs/CLIENT.md).
            print(f"alpha also leased the {m['type']} it read with recv")
        await alpha.ack_outcome(m["id"], m["leaseId"], "completed")


task.react(lambda reactor: defer.ensureDeferred(main(reactor)))

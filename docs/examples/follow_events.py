"""RelayClient.events: an agent that sleeps until its event stream says a message
is waiting, then pulls it; and a stream resumed after the last event seen.

Run it against a broker that advertises events, with its secret:

    DSH_RELAY_SECRET_FILE=conf/relay.secret .venv/bin/python docs/examples/follow_events.py
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
    await alpha.register()
    await beta.register()

    # From now on (a reading fails with "unsupported" where the broker lacks events).
    opened = defer.Deferred()
    stream = beta.events(on_state=lambda up: up and not opened.called and opened.callback(up))
    await opened  # the stream is open: what happens now is in it
    await alpha.send("example-beta", {"text": "first"}, kind="request")
    await alpha.send("example-beta", {"text": "second"})
    seen = []
    async for event in stream:  # reconnects by itself; a "reset" comes here too
        if event.type == "message":  # never a body: an event says what to pull
            print(f"event: a {event.data['kind']} from {event.data['from']}")
            taken = await beta.pull(limit=1)
            for message in taken["messages"]:
                print(f"pulled: {message['body']['text']}")
                await beta.ack_outcome(message["id"], message["leaseId"], "completed")
            seen.append(event.id)
        if len(seen) == 2:
            break
    stream.close()

    # A later run resumes after the last event it handled: here, the first one.
    again = beta.events(since=seen[0])
    async for event in again:
        print(f"resumed: {event.type} {event.id == seen[1]}")
        break
    again.close()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))

"""twistd plugins: ``relay`` (the broker) and ``relay-agent`` (the agent runtime)."""

from twisted.application.service import ServiceMaker

relay = ServiceMaker(
    "dsh-agent-relay broker",
    "relay.broker.tap",
    "The dsh-agent-relay message broker (HMAC-authenticated HTTP relay for agents).",
    "relay",
)

relayAgent = ServiceMaker(
    "dsh-agent-relay agent runtime",
    "relay.agent.tap",
    "Run one relay agent: lease requests, run a handler, reply and ack.",
    "relay-agent",
)

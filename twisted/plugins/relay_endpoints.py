"""The relay's endpoint-string parser: ``relay-tls:``, the checked TLS listener."""

from relay.broker.tls import TLSListenerParser

relayTLS = TLSListenerParser()

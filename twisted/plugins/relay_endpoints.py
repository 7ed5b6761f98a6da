"""The relay's endpoint-string parser: ``relay-tls:``, the checked TLS listener."""

from relay.tls import TLSListenerParser

relayTLS = TLSListenerParser()

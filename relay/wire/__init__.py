"""The wire: what the broker and every client of it agree on.

The protocol's constants and request validation (:mod:`relay.wire.protocol`),
the §3 request signature (:mod:`relay.wire.signing`), the one error type every
layer raises and every client sees (:mod:`relay.wire.errors`), and the second
wire's canonical JSON, signatures and envelope (:mod:`relay.wire.v2`). Pure: no
reactor, no I/O; nothing here imports another package of the relay.
"""

"""The second wire: the reference broker's v2/v3 protocol, as pure functions.

docs/WIRE-V2.md (the project's page) and the reference's PROTOCOL-V2 define it.
This package holds what the broker and every client of that wire must agree on
byte for byte: the canonical JSON of a body (:mod:`relay.wire.v2.canonical`),
the two signature schemes (:mod:`relay.wire.v2.signing`), and how a stored
message looks in its envelope (:mod:`relay.wire.v2.views`). No reactor and no I/O.

The broker's side of the wire has the same place in each layer: its transitions
(:mod:`relay.rules.v2.transitions`, pure), its operations
(:mod:`relay.broker.v2.operations`) and its routes (:mod:`relay.broker.v2.api`).
"""

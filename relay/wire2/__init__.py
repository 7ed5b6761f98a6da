"""The second wire: the reference broker's v2/v3 protocol, as pure functions.

docs/WIRE-V2.md (the project's page) and the reference's PROTOCOL-V2 define it.
This package holds what the broker and every client of that wire must agree on
byte for byte: the canonical JSON of a body (:mod:`relay.wire2.canonical`) and
the two signature schemes (:mod:`relay.wire2.signing`). No reactor and no I/O.

The broker's side of the wire sits beside them: the mapping between its envelope
and the one store's messages (:mod:`relay.wire2.views`, pure), its transitions
(:mod:`relay.wire2.transitions`, pure), its operations
(:mod:`relay.wire2.operations`) and its routes (:mod:`relay.wire2.api`).
"""

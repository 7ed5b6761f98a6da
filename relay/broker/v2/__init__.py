"""The broker's side of the second wire (WIRE-V2): its operations over the one store
(:mod:`relay.broker.v2.operations`) and its routes (:mod:`relay.broker.v2.api`).
See :mod:`relay.wire.v2`."""

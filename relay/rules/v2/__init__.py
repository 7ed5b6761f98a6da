"""The second wire's rules: its delivery transitions over the one store's messages
(:mod:`relay.rules.v2.transitions`). See :mod:`relay.wire.v2`."""

"""The broker's rules, decided without a reactor: what the broker and every store
apply, so that no store imports the broker.

The delivery rules: the ``Message`` record and its transitions
(:mod:`relay.rules.delivery`, and the second wire's in :mod:`relay.rules.v2`),
the events a change causes (:mod:`relay.rules.events`), every decision about
webhooks (:mod:`relay.rules.hooks`); authentication, lockouts and rate limits
(:mod:`relay.rules.auth`); and the configuration they read: the table of settings
and the frozen ``Config`` (:mod:`relay.rules.config`), with the endpoint strings
it names (:mod:`relay.rules.endpoints`). Time is the ``now`` or the clock a
caller hands in.
"""

"""The broker: the running service that applies the rules to one store.

- :mod:`relay.broker.operations`: :class:`~relay.broker.operations.Broker`, every
  operation of the wire protocol (policy, the routing ACL, which transition the
  store applies, wake-ups), with :mod:`~relay.broker.waiters` (long polls),
  :mod:`~relay.broker.counters` (running totals), :mod:`~relay.broker.streams`
  (open event streams) and :mod:`~relay.broker.webhooks` (the delivery loop);
- HTTP: :mod:`~relay.broker.api` (the Klein app of the wire's routes, and
  :mod:`~relay.broker.v2` for the second wire), :mod:`~relay.broker.site` (the
  twisted.web site under it), :mod:`~relay.broker.jsonapi` (what both Klein apps
  share), :mod:`~relay.broker.tls` (the TLS listener), :mod:`~relay.broker.loopback`
  (the site served in memory), and the pages for people it serves:
  :mod:`~relay.broker.ops` (the ops listener and dashboard) and
  :mod:`~relay.broker.inbox` (the human inbox);
- the process: :mod:`~relay.broker.assembly` (the composition root),
  :mod:`~relay.broker.service` (start, stop, reload), :mod:`~relay.broker.tap`
  (``twistd relay``) and :mod:`~relay.broker.warmup`.
"""

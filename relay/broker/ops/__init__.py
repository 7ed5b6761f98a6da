"""Operations: the broker's counters, the ops listener (``/healthz``, ``/metrics``,
the dashboard and its JSON API) and what they read.

The counters themselves are the broker's (:mod:`relay.broker.counters`); this package
reads them, and asks the broker for the rest (queue depths, health, waiting
requests), never its store or waiters. It is used only when
``broker.opsListen`` is set or a test asks for it.
"""

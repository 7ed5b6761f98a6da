"""Operations: the broker's counters, the ops listener (``/healthz``, ``/metrics``,
the dashboard and its JSON API) and what they read.

:mod:`relay.ops.counters` is pure and imported by the broker; the rest is used
only when ``broker.opsListen`` is set or a test asks for it.
"""

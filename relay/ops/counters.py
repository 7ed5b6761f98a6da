"""The former home of :class:`relay.counters.Counters`, which now lives beside the broker
(:mod:`relay.counters`); this module re-exports its public names."""

from relay.counters import (  # noqa: F401
    FLOW_SAMPLES,
    HISTORY_SAMPLES,
    MAX_FLOW_PAIRS,
    OTHER,
    REFUSALS,
    SAMPLE_SECONDS,
    Counters,
    Histogram,
)

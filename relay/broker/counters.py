"""The broker's running totals: what ``/metrics`` and the dashboard report.

A domain-level record beside the broker: the broker, the site and the
authenticator add to it; the ops listener (:mod:`relay.broker.ops`) reads it.
Pure: no reactor, no I/O, no locks (everything runs on the reactor thread).
Counting is on the hot path of every request, so each event costs a few
integer increments and dictionary lookups and allocates nothing of its own;
histograms are a bisect into fixed bounds. Everything is bounded: label values
come from fixed sets (routes, status codes, reasons), and the per-pair message
flow keeps at most :data:`MAX_FLOW_PAIRS` pairs per interval (the rest are
summed under :data:`OTHER`).

:meth:`Counters.sample`, called every :data:`SAMPLE_SECONDS`, keeps the
history the dashboard draws: totals for the last :data:`HISTORY_SAMPLES`
intervals (15 minutes) and the flow between agents for the last
:data:`FLOW_SAMPLES` intervals (5 minutes).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

SAMPLE_SECONDS = 10.0
HISTORY_SAMPLES = 90
FLOW_SAMPLES = 30
MAX_FLOW_PAIRS = 500
OTHER = "_other"
REFUSALS = ("disk_full", "inbox_full")
# The route names of the v2/v3 wire's requests start so (relay.broker.v2.api).
WIRE2_ROUTE_PREFIX = "v2_"
WIRES = ("seed", "v2")

# Seconds; the long polls of /v1/pull and GET /messages wait up to 20.
HTTP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 20.0, 30.0)
COMMIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Counts of observations per bucket (upper bounds, as Prometheus ``le``) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> List[Tuple[str, int]]:
        """``(le, count)`` pairs, cumulative, ending with ``+Inf``."""
        out = []
        running = 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class Sample:
    """The totals at one moment (epoch seconds)."""

    at: float
    sent: int
    delivered: int
    acked: int
    dead_lettered: int
    requests: int
    errors: int  # 5xx answers


class Counters:
    """Totals since the broker started, and the recent history of a few of them."""

    def __init__(self) -> None:
        self.sent = 0
        self.delivered = 0
        self.acked: Dict[str, int] = {}
        self.dead_lettered: Dict[str, int] = {}
        self.expired = 0
        self.lease_expirations = 0
        self.auth_failures: Dict[str, int] = {}
        self.lockouts = 0
        # why sends were refused before anything was stored: inbox_full, disk_full
        self.refused: Dict[str, int] = {}
        # route -> status code -> count, and route -> durations
        self.http: Dict[str, Dict[int, int]] = {}
        self.http_seconds: Dict[str, Histogram] = {}
        self.commit_seconds = Histogram(COMMIT_BUCKETS)
        # sender -> recipient -> messages stored since the last sample
        self.flow: Dict[str, Dict[str, int]] = {}
        self._flow_pairs = 0
        self._flow_since: Optional[float] = None  # when the current interval began
        # (when each past interval began, its flow)
        self.flow_history: Deque[Tuple[Optional[float], Dict[str, Dict[str, int]]]] = deque(
            maxlen=FLOW_SAMPLES)
        self.history: Deque[Sample] = deque(maxlen=HISTORY_SAMPLES + 1)
        # REACH §11: event streams opened and events written to them
        self.streams_opened = 0
        self.events_sent = 0
        # REACH §12: webhook requests sent, those that failed, events skipped, and
        # webhooks disabled
        self.webhook_attempts = 0
        self.webhook_failures = 0
        self.webhook_skips = 0
        self.webhooks_disabled = 0
        # REACH §13: group sends stored, by group (names come from the config)
        self.group_sends: Dict[str, int] = {}

    # -- events (the hot path) ---------------------------------------------------------

    def group_sent(self, group: str) -> None:
        """A send to ``group:<group>`` stored its copies (each also counts as sent)."""
        self.group_sends[group] = self.group_sends.get(group, 0) + 1

    def message_stored(self, sender: str, recipient: str) -> None:
        """A message was stored (a send, a v1.0 receipt; a duplicate is not one)."""
        self.sent += 1
        row = self.flow.get(sender)
        if row is not None and recipient in row:
            row[recipient] += 1
        else:
            self._new_pair(sender, recipient)

    def _new_pair(self, sender: str, recipient: str) -> None:
        if self._flow_pairs >= MAX_FLOW_PAIRS:
            sender = recipient = OTHER
        row = self.flow.setdefault(sender, {})
        if recipient not in row:
            self._flow_pairs += 1
            row[recipient] = 0
        row[recipient] += 1

    def messages_delivered(self, count: int) -> None:
        """Messages handed to a recipient: leases granted, or returned by a v1.0 poll."""
        self.delivered += count

    def stream_opened(self) -> None:
        """An event stream (``GET /v1/events``) was opened."""
        self.streams_opened += 1

    def events_streamed(self, count: int) -> None:
        """``count`` events were written to an event stream."""
        self.events_sent += count

    def webhook_attempted(self) -> None:
        """A webhook request was sent."""
        self.webhook_attempts += 1

    def webhook_failed(self) -> None:
        """A webhook request failed (no 2xx within 10 s)."""
        self.webhook_failures += 1

    def webhook_skipped(self) -> None:
        """An event was skipped after broker.webhookMaxAttempts failed tries."""
        self.webhook_skips += 1

    def webhook_disabled(self) -> None:
        """A webhook was disabled after broker.webhookDisableAfter failed tries in a row."""
        self.webhooks_disabled += 1

    def message_acked(self, outcome: str) -> None:
        self.acked[outcome] = self.acked.get(outcome, 0) + 1

    def message_dead_lettered(self, reason: str) -> None:
        """A message became ``failed``; ``reason`` says why (``attempts``, …)."""
        self.dead_lettered[reason] = self.dead_lettered.get(reason, 0) + 1

    def messages_expired(self, count: int) -> None:
        self.expired += count

    def leases_lapsed(self, count: int) -> None:
        self.lease_expirations += count

    def auth_failed(self, reason: str) -> None:
        self.auth_failures[reason] = self.auth_failures.get(reason, 0) + 1

    def send_refused(self, reason: str) -> None:
        """A message was not stored: its recipient's inbox was full (``inbox_full``)
        or the broker's disk nearly so (``disk_full``)."""
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def agent_locked(self, agent: str) -> None:
        self.lockouts += 1

    def commit_timed(self, seconds: float) -> None:
        self.commit_seconds.observe(seconds)

    def http_answered(self, route: str, code: int, seconds: float) -> None:
        """One HTTP request answered: its route (a fixed name), status and duration."""
        codes = self.http.get(route)
        if codes is None:
            codes = self.http[route] = {}
            self.http_seconds[route] = Histogram(HTTP_BUCKETS)
        codes[code] = codes.get(code, 0) + 1
        self.http_seconds[route].observe(seconds)

    def requests_by_wire(self) -> Dict[str, int]:
        """Requests answered per wire (WIRE-V2): ``v2`` for the v2/v3 routes (named
        ``v2_*``), ``seed`` for every other; read from the per-route counts, so
        counting costs a request nothing more."""
        out = {"seed": 0, "v2": 0}
        for route, codes in self.http.items():
            out["v2" if route.startswith(WIRE2_ROUTE_PREFIX) else "seed"] += sum(codes.values())
        return out

    # -- history -------------------------------------------------------------------------

    def sample(self, now: float) -> Sample:
        """Record the totals at ``now`` and start a new flow interval."""
        requests = errors = 0
        for codes in self.http.values():
            for code, count in codes.items():
                requests += count
                if code >= 500:
                    errors += count
        sample = Sample(now, self.sent, self.delivered, sum(self.acked.values()),
                        sum(self.dead_lettered.values()), requests, errors)
        self.history.append(sample)
        self.flow_history.append((self._flow_since, self.flow))
        self.flow = {}
        self._flow_pairs = 0
        self._flow_since = now
        return sample

    def throughput(self) -> List[Dict[str, Any]]:
        """Per sample interval, oldest first: its end (epoch seconds) and the rate per
        second of sent, delivered, acked and dead-lettered messages, requests and errors."""
        out = []
        samples = list(self.history)
        for before, after in zip(samples, samples[1:]):
            seconds = after.at - before.at
            if seconds <= 0:
                continue
            out.append({
                "at": after.at,
                "sent": (after.sent - before.sent) / seconds,
                "delivered": (after.delivered - before.delivered) / seconds,
                "acked": (after.acked - before.acked) / seconds,
                "deadLettered": (after.dead_lettered - before.dead_lettered) / seconds,
                "requests": (after.requests - before.requests) / seconds,
                "errors": (after.errors - before.errors) / seconds,
            })
        return out

    def recent_flow(self, limit: int = MAX_FLOW_PAIRS) -> Dict[str, Any]:
        """Messages stored per (sender, recipient) over the flow history and the
        current interval: ``{"since", "pairs": [{"from", "to", "count"}]}``, the
        busiest ``limit`` pairs first."""
        totals: Dict[Tuple[str, str], int] = {}
        for _, flow in list(self.flow_history) + [(None, self.flow)]:
            for sender, row in flow.items():
                for recipient, count in row.items():
                    key = (sender, recipient)
                    totals[key] = totals.get(key, 0) + count
        pairs = sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:limit]
        since = self.flow_history[0][0] if self.flow_history else self._flow_since
        return {
            "since": since,
            "pairs": [{"from": s, "to": r, "count": n} for (s, r), n in pairs],
        }

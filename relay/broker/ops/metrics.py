"""``GET /metrics``: the broker's figures in the Prometheus text format.

Counters and histograms come from :class:`relay.broker.counters.Counters`; the
queue gauges from the store's :class:`~relay.store.interface.QueueDepth` list,
read once per scrape. Per-agent series exist only for agents with messages
queued, leased, delayed or failed, at most :data:`MAX_AGENT_SERIES` of them
(the busiest); the rest are summed under ``agent="_other"``, so a client
cycling through agent names cannot blow up a scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Mapping, Optional, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest

from relay.broker.counters import OTHER, REFUSALS, WIRES, Counters
from relay.rules.auth import FAILURE_REASONS
from relay.rules.delivery import DEAD_REASONS
from relay.store.interface import QueueDepth
from relay.wire.protocol import OUTCOMES

MAX_AGENT_SERIES = 1000
QUEUE_STATES = ("queued", "leased", "delayed", "failed")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Scrape:
    """What one scrape reports besides the counters: read just before it."""

    now: float
    depths: Sequence[QueueDepth]
    pull_waiting: int
    agents_online: int
    version: str
    storage: str
    agents_registered: int = 0
    disk_free_bytes: Optional[int] = None
    event_streams: int = 0
    # REACH §13: relay.broker.operations.Broker.role_queues
    roles: Sequence[Mapping[str, Any]] = ()


def capped_depths(depths: Iterable[QueueDepth], limit: int = MAX_AGENT_SERIES) -> List[QueueDepth]:
    """The ``limit`` agents with the most messages (then by name), and the others summed
    as one ``_other`` entry whose oldest message is the oldest of theirs."""
    ordered = sorted(depths, key=lambda d: (-(d.queued + d.leased + d.delayed + d.failed),
                                            d.agent))
    kept, rest = ordered[:limit], ordered[limit:]
    if rest:
        oldest = [d.oldest_queued for d in rest if d.oldest_queued is not None]
        kept.append(QueueDepth(
            OTHER,
            queued=sum(d.queued for d in rest),
            leased=sum(d.leased for d in rest),
            failed=sum(d.failed for d in rest),
            delayed=sum(d.delayed for d in rest),
            oldest_queued=min(oldest) if oldest else None,
        ))
    return kept


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict, known: Sequence[str]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key in sorted(set(known) | set(values)):
        family.add_metric([key], values.get(key, 0))
    return family


class Report:
    """The metric families of one scrape (``collect()``, as a prometheus_client registry)."""

    def __init__(self, counters: Counters, scrape: Scrape, extra: Iterable = ()) -> None:
        self.counters = counters
        self.scrape = scrape
        self.extra = tuple(extra)

    def collect(self) -> Iterator[Metric]:
        c, s = self.counters, self.scrape
        depths = capped_depths(s.depths)
        queue = GaugeMetricFamily("relay_queue_messages",
                                  "Messages per recipient and state (queued, leased, delayed, "
                                  "failed: the dead letters).", labels=["agent", "state"])
        oldest = GaugeMetricFamily("relay_queue_oldest_message_age_seconds",
                                   "Age of the recipient's oldest queued message.",
                                   labels=["agent"])
        for depth in depths:
            for state in QUEUE_STATES:
                queue.add_metric([depth.agent, state], getattr(depth, state))
            if depth.oldest_queued is not None:
                oldest.add_metric([depth.agent], max(0.0, s.now - depth.oldest_queued))
        yield queue
        yield oldest
        leases = GaugeMetricFamily("relay_role_leases", "Leased messages of each role's "
                                   "queue, by the member holding them.",
                                   labels=["role", "member"])
        for role in s.roles:
            for member, held in role["leasesBy"].items():
                leases.add_metric([role["name"], member], held)
        yield leases
        yield _counter("relay_messages_sent", "Messages stored (sends and v1.0 receipts; a "
                       "duplicate is not one).", c.sent)
        yield _counter("relay_messages_delivered", "Messages handed to recipients: leases "
                       "granted and messages returned by v1.0 polls.", c.delivered)
        yield _labelled("relay_messages_acked", "Leases settled by /v1/ack, by outcome.",
                        "outcome", c.acked, OUTCOMES)
        yield _labelled("relay_messages_dead_lettered", "Messages that became failed, by reason.",
                        "reason", c.dead_lettered, DEAD_REASONS)
        yield _counter("relay_messages_expired", "Messages that outlived messageTtlDays or their "
                       "ttlSeconds (removed, or kept as expired).", c.expired)
        yield _counter("relay_lease_expirations", "Leases released because their deadline "
                       "passed.", c.lease_expirations)
        yield GaugeMetricFamily("relay_pull_waiting", "Long-poll requests waiting (/v1/pull "
                                "waitSeconds and GET /messages wait).", value=s.pull_waiting)
        yield GaugeMetricFamily("relay_event_streams", "Event streams open (GET /v1/events).",
                                value=s.event_streams)
        yield _counter("relay_event_streams_opened", "Event streams opened.", c.streams_opened)
        yield _counter("relay_events_streamed", "Events written to event streams.",
                       c.events_sent)
        yield _counter("relay_webhook_attempts", "Webhook requests sent.", c.webhook_attempts)
        yield _counter("relay_webhook_failures", "Webhook requests without a 2xx answer "
                       "within 10 s.", c.webhook_failures)
        yield _counter("relay_webhook_skips", "Events skipped after "
                       "broker.webhookMaxAttempts failed tries.", c.webhook_skips)
        yield _counter("relay_webhooks_disabled", "Webhooks disabled after "
                       "broker.webhookDisableAfter failed tries in a row.",
                       c.webhooks_disabled)
        yield GaugeMetricFamily("relay_agents_online", "Agents with a heartbeat in the last "
                                "90 seconds.", value=s.agents_online)
        requests = CounterMetricFamily("relay_http_requests", "HTTP requests answered by the "
                                       "main listener, by route and status code.",
                                       labels=["route", "code"])
        durations = HistogramMetricFamily("relay_http_request_duration_seconds",
                                          "Time from a request's arrival to its answer, by "
                                          "route (long polls included).", labels=["route"])
        for route in sorted(c.http):
            for code, count in sorted(c.http[route].items()):
                requests.add_metric([route, str(code)], count)
            histogram = c.http_seconds[route]
            durations.add_metric([route], histogram.cumulative(), histogram.total)
        yield requests
        yield durations
        yield _labelled("relay_wire_requests", "HTTP requests answered by the main listener, "
                        "by wire: seed, or v2 (the reference's v2/v3 wire).", "wire",
                        c.requests_by_wire(), WIRES)
        yield _labelled("relay_auth_failures", "Requests refused by authentication, by reason.",
                        "reason", c.auth_failures, FAILURE_REASONS)
        yield _counter("relay_lockouts", "Agents locked after repeated authentication failures.",
                       c.lockouts)
        yield _labelled("relay_sends_refused", "Messages not stored because the recipient's "
                        "inbox was full (inbox_full) or the disk nearly so (disk_full).",
                        "reason", c.refused, REFUSALS)
        yield _labelled("relay_group_sends", "Sends to a group whose copies were stored, by "
                        "group (each copy also counts in relay_messages_sent).", "group",
                        c.group_sends, ())
        yield GaugeMetricFamily("relay_agents_registered", "Agents registered (broker.maxAgents "
                                "caps them).", value=s.agents_registered)
        if s.disk_free_bytes is not None:
            yield GaugeMetricFamily("relay_disk_free_bytes", "Bytes free where the store "
                                    "writes (sends are refused below broker.minFreeDiskMB).",
                                    value=s.disk_free_bytes)
        commits = HistogramMetricFamily("relay_store_commit_seconds", "Duration of the store's "
                                        "commits (one per reactor turn with writes).")
        commits.add_metric([], c.commit_seconds.cumulative(), c.commit_seconds.total)
        yield commits
        info = GaugeMetricFamily("relay_build_info", "The broker's version and storage backend.",
                                 labels=["version", "storage"])
        info.add_metric([s.version, s.storage], 1)
        yield info
        for collector in self.extra:
            yield from collector.collect()


def render(counters: Counters, scrape: Scrape, extra: Iterable = ()) -> bytes:
    """The Prometheus text exposition of one scrape."""
    return generate_latest(Report(counters, scrape, extra))

"""The open event streams of ``GET /v1/events`` (REACH §11).

:class:`EventStreams` holds each stream's request and its position (the id of the
last event written). It reads the store's recorded events — never anything held
only in memory — so a stream and a resumed stream see the same events in the same
order, whichever broker recorded them: the store's change report
(:attr:`relay.rules.delivery.Changes.events`, also heard from other brokers on a shared
store) says which agents' streams have something new. One periodic call writes
the ``: keepalive`` comment: every second to one of fifteen slices of the open
streams, so each stream has one every 15 s and ten thousand streams cost the
reactor a few milliseconds a second instead of one long pause every 15 s (which
would hold up the events of that instant).

Limits: at most ``max_per_agent`` streams per agent (a new one closes that agent's
oldest) and ``max_total`` in all (a new one beyond it is ``503 busy``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import implementer

from relay.rules import events
from relay.rules.delivery import Changes
from relay.rules.events import EventPage
from relay.wire import errors

log = Logger(namespace="relay.streams")

EVENT_STREAM_TYPE = b"text/event-stream"


@implementer(IPushProducer)
class Stream:
    """One open stream: the agent's, written to ``request``, after ``position``.

    It is the request's producer: while the client reads slower than events come,
    the transport pauses it and nothing more is read or written for it (the events
    wait in the store, so memory stays bounded and nothing is lost); it reads on
    from its position when resumed."""

    __slots__ = ("agent", "request", "position", "reading", "again", "closed", "done",
                 "paused", "streams", "slot")

    def __init__(self, agent: str, request: Any, position: Optional[int],
                 streams: EventStreams) -> None:
        self.agent = agent
        self.request = request
        self.position = position
        self.reading = False
        self.again = False
        self.closed = False
        self.paused = False
        self.done: Optional[Deferred] = None
        self.streams = streams
        self.slot = 0  # which second of the keepalive period is this stream's

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        if self.again:
            self.streams.read(self)

    def stopProducing(self) -> None:
        self.streams.forget(self)


class EventStreams:
    """Every open event stream of one broker, over the store that records events."""

    def __init__(self, store: Any, clock: IReactorTime, max_per_agent: int,
                 max_total: int, counters: Any = None) -> None:
        self.store = store
        self.clock = clock
        self.max_per_agent = max_per_agent
        self.max_total = max_total
        self.counters = counters
        # agent -> its open streams, oldest first
        self.by_agent: Dict[str, List[Stream]] = {}
        self.total = 0
        # the open streams by keepalive slot (a dict keeps their order)
        self._slots: List[Dict[Stream, None]] = [{} for _ in range(events.KEEPALIVE_SECONDS)]
        self._slot = 0  # the slot written last
        self._keepalive = LoopingCall.withCount(self.keepalive)
        self._keepalive.clock = clock
        self._stopped = False
        store.subscribe(self.changed)

    def configure(self, max_per_agent: int, max_total: int) -> None:
        """Apply the limits of a reloaded config (open streams stay open)."""
        self.max_per_agent = max_per_agent
        self.max_total = max_total

    def counts(self) -> Dict[str, int]:
        """Open streams per agent (the dashboard, ``relay stats``)."""
        return {agent: len(streams) for agent, streams in sorted(self.by_agent.items())}

    # -- opening and closing -----------------------------------------------------------

    def open(self, agent: str, request: Any, position: Optional[int]) -> Deferred:
        """Start ``agent``'s stream on ``request`` after ``position`` (None: the present;
        -1: an unknown id, answered with a ``reset``). Returns the route's Deferred,
        which fires when the broker closes the stream; cancelling it (the client went
        away) closes it too. 503 ``busy`` beyond ``broker.maxStreams``."""
        if self._stopped:
            raise errors.busy("the broker is stopping")
        if self.total >= self.max_total:
            raise errors.busy(f"this broker holds {self.max_total} event streams "
                              "(broker.maxStreams): try again later")
        mine = self.by_agent.get(agent, ())
        while len(mine) >= self.max_per_agent:
            self._close(mine[0])
        stream = Stream(agent, request, position, self)
        stream.done = done = Deferred(lambda _: self.forget(stream))
        self.by_agent.setdefault(agent, []).append(stream)
        self.total += 1
        if self.counters is not None:
            self.counters.stream_opened()
        if position is not None:
            self._start(stream)
            return done
        # "The present" is the agent's last event before the headers go out: a
        # client that sends once it has the answer finds what it caused on the stream.
        stream.reading = True
        d = self.store.events(agent, None, 0)
        d.addCallbacks(self._placed, self._unplaced, callbackArgs=(stream,),
                       errbackArgs=(stream,))
        return done

    def _placed(self, page: EventPage, stream: Stream) -> None:
        stream.reading = False
        if stream.closed:
            return
        stream.position = page.last
        self._start(stream)

    def _unplaced(self, failure: Any, stream: Stream) -> None:
        log.warn("event stream of {agent} not opened: its events could not be read ({kind})",
                 agent=stream.agent, kind=failure.type.__name__)
        done, stream.done = stream.done, None
        self.forget(stream)
        if done is not None and not done.called:
            done.errback(errors.busy("the agent's events could not be read: try again"))

    def _start(self, stream: Stream) -> None:
        """Send the answer's headers and what follows the stream's position."""
        # the slot with the fewest streams: its turn comes within 15 s, and the
        # slots stay even however streams come and go
        stream.slot = min(range(len(self._slots)), key=lambda i: len(self._slots[i]))
        self._slots[stream.slot][stream] = None
        request = stream.request
        request.setResponseCode(200)
        headers = request.responseHeaders
        headers.setRawHeaders(b"content-type", [EVENT_STREAM_TYPE])
        headers.setRawHeaders(b"cache-control", [b"no-store"])
        headers.setRawHeaders(b"x-accel-buffering", [b"no"])
        request.registerProducer(stream, True)
        request.write(events.KEEPALIVE)  # the headers go out now
        if not self._keepalive.running:
            self._keepalive.start(1, now=False)
        self.read(stream)

    def forget(self, stream: Stream) -> None:
        """Take ``stream`` out of the table (closed by either side)."""
        if stream.closed:
            return
        stream.closed = True
        with contextlib.suppress(AttributeError):  # a request already done has no channel
            stream.request.unregisterProducer()
        mine = self.by_agent.get(stream.agent)
        if mine is not None and stream in mine:
            mine.remove(stream)
            if not mine:
                del self.by_agent[stream.agent]
            self.total -= 1
            self._slots[stream.slot].pop(stream, None)
        if not self.total and self._keepalive.running:
            self._keepalive.stop()

    def _close(self, stream: Stream) -> None:
        """End ``stream`` from the broker's side: its response finishes."""
        self.forget(stream)
        done, stream.done = stream.done, None
        if done is not None and not done.called:
            done.callback(b"")

    def stop(self) -> None:
        """Close every stream and open no new one (the broker stops)."""
        self._stopped = True
        for streams in list(self.by_agent.values()):
            for stream in list(streams):
                self._close(stream)

    # -- writing -----------------------------------------------------------------------

    def changed(self, changes: Changes) -> None:
        """The store recorded events for ``changes.events``: their streams read them."""
        agents = changes.events
        if not agents or not self.total:
            return
        if events.ALL_AGENTS in agents:
            agents = set(self.by_agent)
        for agent in agents:
            for stream in list(self.by_agent.get(agent, ())):
                self.read(stream)

    def keepalive(self, seconds: int = 1) -> None:
        """Write the keepalive comment to the streams whose turn came in the last
        ``seconds`` seconds (one slot a second; all of them after 15 s or more)."""
        for _ in range(min(seconds, events.KEEPALIVE_SECONDS)):
            self._slot = (self._slot + 1) % events.KEEPALIVE_SECONDS
            for stream in list(self._slots[self._slot]):
                if not stream.paused:  # a paused stream's client has bytes to read
                    stream.request.write(events.KEEPALIVE)

    def read(self, stream: Stream) -> None:
        """Write the events of ``stream``'s agent after its position (once a read
        under way ends, and once the client has read what it was sent)."""
        if stream.closed:
            return
        if stream.reading or stream.paused:
            stream.again = True
            return
        stream.reading = True
        stream.again = False
        d = self.store.events(stream.agent, stream.position, events.READ_BATCH)
        d.addCallbacks(self._write, self._failed, callbackArgs=(stream,),
                       errbackArgs=(stream,))

    def _write(self, page: EventPage, stream: Stream) -> None:
        stream.reading = False
        if stream.closed:
            return
        request = stream.request
        if page.reset is not None:
            request.write(events.reset_record(page.last, page.reset))
        if page.events:
            request.write(b"".join(events.sse_record(e.id, e.type, e.data)
                                   for e in page.events))
            if self.counters is not None:
                self.counters.events_streamed(len(page.events))
        stream.position = page.last
        if stream.again or len(page.events) >= events.READ_BATCH:
            self.read(stream)

    def _failed(self, failure: Any, stream: Stream) -> None:
        stream.reading = False
        log.warn("event stream of {agent} closed: its events could not be read ({kind})",
                 agent=stream.agent, kind=failure.type.__name__)
        self._close(stream)  # the client resumes from the last id it saw

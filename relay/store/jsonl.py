"""The jsonl backend (``broker.storage: jsonl``): memory indexes and an append-only log.

The state is that of :class:`relay.store.memory.MemoryRecords`; every change is
appended to ``dataDir/messages.jsonl`` and the file is replayed at start. One
JSON object per line:

``{"seq": N, "message": {...}}``
    A full snapshot of one message: the wire envelope (spec §2, §5.1) plus
    ``leaseId``, ``error``, ``created`` (epoch seconds), ``recovery`` (the
    v1.0 recovery-delivery mark) and the v1.2 bookkeeping when it is not the
    default: ``deliveries``, ``deadReason``, and the times (epoch seconds)
    ``notBeforeTime``, ``delayUntilTime``, ``expiresAtTime``, ``completedAt``
    (when it became done or failed; absent in logs of earlier brokers). A message
    of the v2/v3 wire kept past its TTL has the status ``expired``. A later snapshot
    of the same id replaces the earlier one. This is the reference broker's
    own line format (its v1.0 lines lack the v1.1 fields and default to
    ``queued``), so its files load here; new messages are written this way, so
    it can read ours back (it skips the other records).
``{"op": "state", "id": ID, "status", "attempts", "leaseUntil", "leaseId", ...}``
    The delivery state of a message changed (pull, ack, lease lapse, poll, …):
    also ``error``, ``recovery``, ``deliveries``, ``notBeforeTime``, ``deadReason``,
    and when set ``holder``, ``completedAt`` and ``expiresAtTime`` (a record without
    one of these three leaves it as it was: logs of earlier brokers have none).
``{"op": "peer", "agent": NAME, "lastSeen": SECONDS, "card"?}``
    A registration (heartbeat); ``card`` (an object, or null for none) only when
    the registration changed it.
``{"op": "expire", "through": SEQ}``
    The expiry sweep removed every message up to and including SEQ.
``{"op": "drop", "id": ID}``
    The expiry sweep removed that message (its ``ttlSeconds`` ran out).
``{"op": "forget", "agent": NAME}``
    The agent was forgotten (offline for longer than the message TTL, no message
    addressed to it).
``{"op": "next", "seq": N}``
    The next sequence number (head of a compacted file), so seqs never repeat.
``{"op": "event", "id": N, "agent": NAME, "at": SECONDS, "type": TYPE, "data": {...}}``
    An event of REACH §11 (``data`` never holds a body).
``{"op": "webhook", "agent": NAME, "state": {...} or null}``
    The agent's webhook (REACH §12) and its progress; null: none.
``{"op": "events", "floor": N, "last": N, "anchors": {NAME: N, ...}, "anchored": N}``
    Retention removed every event up to id ``floor``; ``last`` is the highest
    id given so far (also the head of a compacted file), so ids never repeat;
    ``anchors`` the newest event removed of each agent concerned (all of them at
    the head of a compacted file) and ``anchored`` the floor from which on they
    were kept (both absent in logs of earlier brokers: such a log's floor is then
    where a resumed stream of any agent may have lost events).

A line that is not one of these — a corrupt one, or a torn last line after a
crash — is skipped, counted and logged by its line number only; a torn last
line is then cut off, so the next record starts on a line of its own.

Durability follows ``broker.sync``: the records of one reactor turn are
written with one ``write`` before any of that turn's Deferreds fire (so a
killed process loses nothing acknowledged); ``full`` also fsyncs that write.
``off`` behaves like ``normal`` here. A failed write (a full disk) fails
that turn's requests, and the turn is undone: the file is cut back to the end
of its last whole record (what was acknowledged, and nothing else) and the
state in memory is read again from it. A request that got an error and is sent
again is then stored as if for the first time.

Compaction: when the file holds more than twice as many records as there are
live messages and peers (and at least ``compact_min_records``), a new file
with one record per live message and peer is written beside it in chunks, one
per reactor turn; records appended meanwhile also go to the new file; it is
fsynced, renamed over the old one and the directory fsynced. Until the rename
the old file stays complete, so a crash during compaction loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Mapping, Optional

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.files.private import FreeSpace, private_file
from relay.rules.config import SYNC_LEVELS, Config, Setting, check_keys, read_settings, table_keys
from relay.rules.delivery import DEAD_REASONS, Message
from relay.rules.events import MESSAGE, STATUS, Event
from relay.store import make_data_dir, off_the_reactor
from relay.store.grouped import GroupCommit
from relay.store.memory import MemoryRecords
from relay.store.records import RecordStore
from relay.wire.errors import ConfigError, RelayError
from relay.wire.protocol import (
    KEEP_CARD,
    MAX_PRIORITY,
    MESSAGE_KINDS,
    MESSAGE_TYPES,
    STORED_STATUSES,
    compact_json,
    iso_seconds,
    iso_timestamp,
    parse_card,
)

log = Logger(namespace="relay.store.jsonl")

LOG_NAME = "messages.jsonl"
COMPACT_SUFFIX = ".compact"
COMPACT_MIN_RECORDS = 10_000
COMPACT_CHUNK = 1000
LOGGED_SKIPS = 20
EVENT_TYPES = (MESSAGE, STATUS)


# -- records ---------------------------------------------------------------------


def _encode(record: Dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode("utf-8") + b"\n"


def snapshot_record(message: Message) -> Dict[str, Any]:
    """The full-snapshot record of ``message`` (the reference broker's line format)."""
    return json.loads(snapshot_line(message))


def snapshot_line(message: Message) -> bytes:
    """:func:`snapshot_record` as one encoded line, the body's stored text spliced in."""
    extra: Dict[str, Any] = {"leaseId": message.lease_id}
    if message.error is not None:
        extra["error"] = message.error
    extra["created"] = message.created
    if message.recovery:
        extra["recovery"] = True
    for key, value in (("deliveries", message.deliveries or None),
                       ("deadReason", message.dead_reason),
                       ("notBeforeTime", message.not_before),
                       ("delayUntilTime", message.delay_until),
                       ("expiresAtTime", message.expires_at),
                       ("sentId", message.sent_id),
                       ("wireV2", message.v2),
                       ("holder", message.holder),
                       ("completedAt", message.completed_at)):
        if value is not None:
            extra[key] = value
    # The envelope without its view-only fields (the times are kept as epoch seconds).
    envelope = _plain(message).envelope_json()
    members = json.dumps(extra, separators=(",", ":"))[1:-1]
    return (b'{"seq":%d,"message":' % message.seq
            + f"{envelope[:-1]},{members}}}}}\n".encode())


def _plain(message: Message) -> Message:
    plain = message.copy()
    plain.expires_at = plain.delay_until = None
    return plain


def state_record(message: Message) -> Dict[str, Any]:
    """The record of a change of ``message``'s delivery state."""
    (status, attempts, lease_until, lease_id, error, recovery, deliveries, not_before,
     dead_reason, holder, completed_at, expires_at) = message.state()
    record = {"op": "state", "id": message.id, "status": status, "attempts": attempts,
              "leaseUntil": lease_until, "leaseId": lease_id, "error": error,
              "recovery": recovery, "deliveries": deliveries, "notBeforeTime": not_before,
              "deadReason": dead_reason}
    if holder is not None:
        record["holder"] = holder
    if completed_at is not None:
        record["completedAt"] = completed_at
    if expires_at is not None:
        record["expiresAtTime"] = expires_at
    return record


def peer_record(agent: str, last_seen: int, card: Any = KEEP_CARD) -> Dict[str, Any]:
    """The record of a registration; ``card`` only when it changed."""
    record: Dict[str, Any] = {"op": "peer", "agent": agent, "lastSeen": last_seen}
    if card is not KEEP_CARD:
        record["card"] = card
    return record


def event_record(event: Event) -> Dict[str, Any]:
    """The log record of ``event``."""
    return {"op": "event", "id": event.id, "agent": event.agent, "at": event.at,
            "type": event.type, "data": json.loads(event.data)}


def webhook_record(agent: str, state: Optional[str]) -> Dict[str, Any]:
    """The log record of ``agent``'s webhook state (None: removed)."""
    return {"op": "webhook", "agent": agent,
            "state": None if state is None else json.loads(state)}


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a number")
    return float(value)


def _time(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a time")
    return float(value)


def _reason(value: Any) -> Optional[str]:
    if value is None or value in DEAD_REASONS:
        return value
    raise ValueError("bad dead reason")


def _card(value: Any) -> Optional[Dict[str, Any]]:
    try:
        return parse_card({"card": value})
    except RelayError:
        raise ValueError("bad card") from None


def _text(value: Any, optional: bool = True) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not value and not optional):
        raise ValueError("not a string")
    return value


def _int(value: Any, optional: bool = False) -> Optional[int]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a number")
    return int(value)


def _created(envelope: Dict[str, Any], now: float) -> float:
    created = envelope.get("created")
    if isinstance(created, (int, float)) and not isinstance(created, bool):
        return float(created)
    ts = envelope.get("ts")
    if isinstance(ts, str):
        seconds = iso_seconds(ts)
        return now if seconds is None else seconds
    return now


def message_from_snapshot(seq: Any, envelope: Any, now: float) -> Message:
    """A Message from a snapshot record; ValueError when it is not one.

    Fields of v1.1 that a v1.0 line lacks get their defaults (``queued``,
    no lease); ``created`` falls back to ``ts``, then to ``now``.
    """
    if not isinstance(envelope, dict):
        raise ValueError("message is not an object")
    seq = _int(seq)
    if seq < 1:
        raise ValueError("bad seq")
    created = _created(envelope, now)
    status = envelope.get("status") or "queued"
    kind = envelope.get("kind") or "message"
    msg_type = envelope.get("type") or "message"
    body = envelope.get("body")
    if (status not in STORED_STATUSES or kind not in MESSAGE_KINDS
            or msg_type not in MESSAGE_TYPES):
        raise ValueError("bad enumeration")
    if body is not None and not isinstance(body, dict):
        raise ValueError("body is not an object")
    ts = envelope.get("ts")
    return Message(
        seq=seq,
        id=_text(envelope.get("id"), optional=False),
        sender=_text(envelope.get("from"), optional=False),
        to=_text(envelope.get("to"), optional=False),
        created=created,
        ts=ts if isinstance(ts, str) else iso_timestamp(created),
        type=msg_type,
        body=body,
        reply_to=_text(envelope.get("replyTo")),
        ack=bool(envelope.get("ack", False)),
        kind=kind,
        root_id=_text(envelope.get("rootId")),
        parent_id=_text(envelope.get("parentId")),
        status=status,
        attempts=_int(envelope.get("attempts") or 0),
        lease_until=_int(envelope.get("leaseUntil"), optional=True),
        lease_id=_text(envelope.get("leaseId")),
        error=_text(envelope.get("error")),
        recovery=bool(envelope.get("recovery", False)),
        deliveries=_int(envelope.get("deliveries") or 0),
        dead_reason=_reason(envelope.get("deadReason")),
        not_before=_time(envelope.get("notBeforeTime")),
        delay_until=_time(envelope.get("delayUntilTime")),
        expires_at=_time(envelope.get("expiresAtTime")),
        via=_text(envelope.get("via")),
        sent_id=_text(envelope.get("sentId")),
        v2=_text(envelope.get("wireV2")),
        priority=_priority(envelope.get("priority")),
        holder=_text(envelope.get("holder")),
        completed_at=_time(envelope.get("completedAt")),
    )


def _priority(value: Any) -> int:
    priority = _int(value or 0)
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError("bad priority")
    return priority


def _apply_state(message: Message, record: Dict[str, Any]) -> None:
    status = record["status"]
    if status not in STORED_STATUSES:
        raise ValueError("bad status")
    attempts = _int(record["attempts"])
    lease_until = _int(record.get("leaseUntil"), optional=True)
    lease_id = _text(record.get("leaseId"))
    error = _text(record.get("error"))
    message.status = status
    message.attempts = attempts
    message.lease_until = lease_until
    message.lease_id = lease_id
    deliveries = _int(record.get("deliveries") or 0)
    not_before = _time(record.get("notBeforeTime"))
    dead_reason = _reason(record.get("deadReason"))
    message.error = error
    message.recovery = bool(record.get("recovery", False))
    message.deliveries = deliveries
    message.not_before = not_before
    message.dead_reason = dead_reason
    message.holder = _text(record.get("holder"))
    if "completedAt" in record:
        message.completed_at = _time(record["completedAt"])
    if "expiresAtTime" in record:
        message.expires_at = _time(record["expiresAtTime"])


class LoadedLog:
    """What replaying a log gave: live messages in seq order, peers, counters."""

    def __init__(self) -> None:
        self.messages: List[Message] = []
        self.peers: Dict[str, int] = {}
        self.cards: Dict[str, Dict[str, Any]] = {}
        self.next_seq = 1
        self.records = 0
        self.skipped = 0
        self.ends_with_newline = True
        self.whole_bytes = 0  # the length of the file up to its last whole line
        self.events: List[Event] = []
        self.event_floor = 0
        self.event_anchors: Dict[str, int] = {}
        self.events_anchored_from: Optional[int] = None
        self.hooks: Dict[str, str] = {}
        self.last_event = 0


def read_log(path: str, now: float) -> LoadedLog:
    """Replay the log at ``path`` (this backend's or the reference broker's).

    Unreadable lines are skipped, counted in ``skipped`` and logged by line
    number. Raises OSError when the file cannot be read.
    """
    loaded = LoadedLog()
    by_id: Dict[str, Message] = {}
    through = 0
    max_seq = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            loaded.ends_with_newline = line.endswith(b"\n")
            if loaded.ends_with_newline:
                loaded.whole_bytes += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
                op = record.get("op")
                if op is None:
                    message = message_from_snapshot(record["seq"], record["message"], now)
                    by_id[message.id] = message
                    max_seq = max(max_seq, message.seq)
                elif op == "state":
                    target = by_id.get(_text(record["id"], optional=False))
                    if target is not None:
                        _apply_state(target, record)
                elif op == "peer":
                    agent = _text(record["agent"], optional=False)
                    last_seen = _int(record["lastSeen"])
                    card = _card(record["card"]) if "card" in record else KEEP_CARD
                    loaded.peers[agent] = last_seen
                    if card is None:
                        loaded.cards.pop(agent, None)
                    elif card is not KEEP_CARD:
                        loaded.cards[agent] = card
                elif op == "expire":
                    through = max(through, _int(record["through"]))
                elif op == "drop":
                    by_id.pop(_text(record["id"], optional=False), None)
                elif op == "forget":
                    agent = _text(record["agent"], optional=False)
                    loaded.peers.pop(agent, None)
                    loaded.cards.pop(agent, None)
                elif op == "next":
                    max_seq = max(max_seq, _int(record["seq"]) - 1)
                elif op == "event":
                    data = record["data"]
                    if not isinstance(data, dict) or record["type"] not in EVENT_TYPES:
                        raise ValueError("not an event")
                    loaded.events.append(Event(
                        _int(record["id"]), _text(record["agent"], optional=False),
                        record["type"], compact_json(data), _number(record["at"])))
                elif op == "webhook":
                    agent = _text(record["agent"], optional=False)
                    state = record["state"]
                    if state is None:
                        loaded.hooks.pop(agent, None)
                    elif isinstance(state, dict):
                        loaded.hooks[agent] = compact_json(state)
                    else:
                        raise ValueError("not a webhook state")
                elif op == "events":
                    loaded.event_floor = max(loaded.event_floor, _int(record["floor"]))
                    loaded.last_event = max(loaded.last_event, _int(record["last"]))
                    anchors = record.get("anchors", {})
                    if not isinstance(anchors, dict):
                        raise ValueError("not anchors")
                    for agent, anchor in anchors.items():
                        loaded.event_anchors[agent] = max(loaded.event_anchors.get(agent, 0),
                                                          _int(anchor))
                    if "anchored" in record and loaded.events_anchored_from is None:
                        loaded.events_anchored_from = _int(record["anchored"])
                else:
                    raise ValueError("unknown op")
            except (ValueError, KeyError, TypeError, RecursionError):
                loaded.skipped += 1
                if loaded.skipped <= LOGGED_SKIPS:
                    log.warn("skipped unreadable line {line} of {path}", line=number, path=path)
                continue
            loaded.records += 1
    seen = set()
    next_seq = max(max_seq, through) + 1
    for message in sorted(by_id.values(), key=lambda m: m.seq):
        if message.seq <= through:
            continue
        if message.seq in seen:  # two ids claim one seq: keep both, in file order
            message.seq = next_seq
            next_seq += 1
        seen.add(message.seq)
        loaded.messages.append(message)
    loaded.next_seq = next_seq
    loaded.events = sorted((e for e in loaded.events if e.id > loaded.event_floor),
                           key=lambda e: e.id)
    return loaded


# -- state --------------------------------------------------------------------------


class LoggedRecords(MemoryRecords):
    """MemoryRecords that hand a record of every change to ``append``."""

    def __init__(self, append) -> None:
        super().__init__()
        self.append = append

    def inserted(self, stored: Message) -> None:
        self.append(snapshot_line(stored))

    def saved(self, stored: Message) -> None:
        self.append(state_record(stored))

    def forgotten(self, agents: List[str]) -> None:
        for agent in agents:
            self.append({"op": "forget", "agent": agent})

    def registered(self, agent: str, card_changed: bool) -> None:
        card = self.cards.get(agent) if card_changed else KEEP_CARD
        self.append(peer_record(agent, self.peer_seen[agent], card))

    def removed(self, messages: List[Message], through: int) -> None:
        if through:
            self.append({"op": "expire", "through": through})
        for message in messages:
            if message.seq > through:
                self.append({"op": "drop", "id": message.id})

    def evented(self, event: Event) -> None:
        self.append(event_record(event))

    def trimmed(self, floor: int, anchors: Dict[str, int]) -> None:
        self.append({"op": "events", "floor": floor, "last": self.last_event,
                     "anchors": anchors, "anchored": self.events_anchored_from})

    def hooked(self, agent: str) -> None:
        self.append(webhook_record(agent, self.hooks.get(agent)))

    def live_records(self) -> int:
        return len(self.by_id) + len(self.peer_seen) + len(self.event_log) + len(self.hooks)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Compaction:
    """One rewrite of the log into ``path + COMPACT_SUFFIX``, a chunk per reactor turn."""

    def __init__(self, store: JsonlStore) -> None:
        self.store = store
        self.tmp_path = store.path + COMPACT_SUFFIX
        private_file(self.tmp_path)
        self.file: IO[bytes] = open(self.tmp_path, "wb")  # noqa: SIM115 (lives across turns)
        state = store.records
        self.seqs = list(state.by_seq)
        self.position = 0
        self.tail: List[bytes] = []
        self.tail_records = 0
        self.records = 1 + len(state.peer_seen)
        self.file.write(_encode({"op": "next", "seq": state.next_seq}))
        head: Dict[str, Any] = {"op": "events", "floor": state.event_floor,
                                "last": state.last_event, "anchors": state.event_anchors}
        if state.events_anchored_from is not None:
            head["anchored"] = state.events_anchored_from
        self.file.write(_encode(head))
        for agent, seen in sorted(state.peer_seen.items()):
            card = state.cards.get(agent, KEEP_CARD)
            self.file.write(_encode(peer_record(agent, seen, card)))
        # the kept events (few: retention bounds them) at once, before any later one
        self.file.write(b"".join(_encode(event_record(e)) for e in state.event_log))
        self.file.write(b"".join(_encode(webhook_record(agent, hook))
                                 for agent, hook in sorted(state.hooks.items())))
        self.records += 1 + len(state.event_log) + len(state.hooks)
        self.waiters: List[Deferred] = []
        self.call = None

    def step(self) -> bool:
        """Write the next chunk; True when every live message is written."""
        by_seq = self.store.records.by_seq
        chunk = self.seqs[self.position : self.position + COMPACT_CHUNK]
        self.position += len(chunk)
        lines = []
        for seq in chunk:
            message = by_seq.get(seq)
            if message is not None:
                lines.append(snapshot_line(message))
        self.file.write(b"".join(lines))
        self.records += len(lines)
        return self.position >= len(self.seqs)

    def written(self, data: bytes, records: int) -> None:
        """Records that reached the old file after the snapshot started."""
        self.tail.append(data)
        self.tail_records += records

    def notify(self, error: Optional[Exception] = None) -> None:
        """Tell the callers of :meth:`JsonlStore.compact` how it ended."""
        waiters, self.waiters = self.waiters, []
        for d in waiters:
            if error is None:
                d.callback(None)
            else:
                d.errback(error)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def finish(self) -> IO[bytes]:
        """Append the tail, make the new file durable, rename it over the old one.

        Returns the new file opened for appending.
        """
        self.file.write(b"".join(self.tail))
        self.records += self.tail_records
        self.sync()
        self.file.close()
        os.replace(self.tmp_path, self.store.path)
        _fsync_directory(os.path.dirname(self.store.path) or ".")
        return open(self.store.path, "ab", buffering=0)

    def abandon(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp_path)


class JsonlStore(RecordStore):
    """Memory records plus an append-only log, written once per reactor turn."""

    name = "jsonl"

    def __init__(self, path: str, file: IO[bytes], reactor: IReactorTime, sync: str,
                 log_records: int = 0) -> None:
        self.path = path
        self.file = file
        self.reactor = reactor
        self.fsync = sync == "full"
        self.log_records = log_records
        self.compact_min_records = COMPACT_MIN_RECORDS
        self.compactions = 0
        self.compaction: Optional[Compaction] = None
        self._compact_after = 0  # after a failed compaction: wait for this many records
        self._buffer: List[bytes] = []
        self._whole = os.fstat(file.fileno()).st_size  # the file's length after its last write
        self._torn = False  # a failed write could not be cut off: start a new line
        self._closed = False
        super().__init__(LoggedRecords(self._append), GroupCommit(reactor, self._write, "jsonl"))
        self.space_left = FreeSpace(os.path.dirname(path), reactor)

    # -- the log ---------------------------------------------------------------------

    def _append(self, record: Any) -> None:
        """Queue a record (a dict, or a line already encoded) for the turn's write."""
        self._buffer.append(record if isinstance(record, bytes) else _encode(record))
        self.commits.touch()

    def _write(self) -> None:
        """Write the turn's records (one write); fsync under ``sync: full``. When the
        write fails, the turn is undone (:meth:`_undo_turn`) and the error raised."""
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        count = len(self._buffer)
        prefix = b"\n" if self._torn else b""
        try:
            self._write_all(prefix + data)
            if self.fsync:
                os.fsync(self.file.fileno())
        except OSError:
            self._undo_turn()
            raise
        # After a write that could not be cut off, the file's length is unknown.
        self._whole = os.fstat(self.file.fileno()).st_size if prefix else self._whole + len(data)
        self._torn = False
        self._buffer = []
        self.log_records += count
        if self.compaction is not None:
            self.compaction.written(data, count)
        elif self._should_compact():
            self.reactor.callLater(0, self._start_compaction)

    def _undo_turn(self) -> None:
        """After a failed write: cut the file back to the end of its last whole
        record, drop the turn's records, and read the state in memory again from
        the file, so both hold what was acknowledged and nothing else. When the
        file cannot be cut, the records stay queued for the next write, which
        starts on a new line."""
        if self.compaction is not None:  # it may have copied the turn's messages
            self._compaction_failed(RuntimeError("a write to the log failed"))
        try:
            os.ftruncate(self.file.fileno(), self._whole)
            loaded = read_log(self.path, self.reactor.seconds())
        except OSError as e:
            self._torn = True
            log.error("cannot cut {path} back after a failed write: {reason}",
                      path=self.path, reason=e.strerror)
            return
        self._buffer = []
        self._torn = False
        self.records = LoggedRecords(self._append)
        _restore(self, loaded)
        self.log_records = loaded.records + loaded.skipped

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self.file.write(view)
            view = view[n:]

    def _should_compact(self) -> bool:
        live = self.records.live_records()
        return (
            self.log_records >= max(self.compact_min_records, self._compact_after)
            and self.log_records > 2 * live
        )

    # -- compaction ------------------------------------------------------------------

    def compact(self) -> Deferred:
        """Rewrite the log now (unless a rewrite is running); fires when it is renamed."""
        compaction = self.compaction or self._start_compaction()
        if compaction is None:
            return fail(RuntimeError("compaction could not start"))
        d: Deferred = Deferred()
        compaction.waiters.append(d)
        return d

    def _start_compaction(self) -> Optional[Compaction]:
        if self.compaction is not None or self._closed:
            return self.compaction
        try:
            self.compaction = Compaction(self)
        except OSError as e:
            log.error("cannot start compacting {path}: {reason}", path=self.path,
                      reason=e.strerror)
            self._compact_after = self.log_records * 2
            return None
        log.info("compacting {path}: {records} records, {live} live",
                 path=self.path, records=self.log_records, live=self.records.live_records())
        self.compaction.call = self.reactor.callLater(0, self._compact_step)
        return self.compaction

    def _compact_step(self) -> None:
        compaction = self.compaction
        if compaction is None:
            return
        compaction.call = None
        try:
            finished = compaction.step()
        except OSError as e:
            self._compaction_failed(e)
            return
        if not finished:
            compaction.call = self.reactor.callLater(0, self._compact_step)
            return
        d = off_the_reactor(self.reactor, compaction.sync)
        d.addCallbacks(lambda _: self._compact_finish(compaction),
                       lambda f: self._compaction_failed(f.value))

    def _compact_finish(self, compaction: Compaction) -> None:
        if self.compaction is not compaction:
            return
        try:
            new = compaction.finish()
        except OSError as e:
            self._compaction_failed(e)
            return
        old, self.file = self.file, new
        old.close()
        self._whole = os.fstat(new.fileno()).st_size
        before = self.log_records
        self.log_records = compaction.records
        self.compaction = None
        self.compactions += 1
        log.info("compacted {path}: {before} records -> {after}",
                 path=self.path, before=before, after=self.log_records)
        compaction.notify()

    def _compaction_failed(self, error: Exception) -> None:
        compaction, self.compaction = self.compaction, None
        if compaction is None:
            return
        if compaction.call is not None and compaction.call.active():
            compaction.call.cancel()
        compaction.abandon()
        log.error("compacting {path} failed: {kind}; the old file stays in use",
                  path=self.path, kind=type(error).__name__)
        self._compact_after = self.log_records * 2
        compaction.notify(error)

    def close(self) -> Deferred:
        """Write what is pending, drop an unfinished compaction, close the file."""
        if self._buffer:
            self.commits.touch()
        self.commits.close()
        self._closed = True
        compaction, self.compaction = self.compaction, None
        if compaction is not None:
            if compaction.call is not None and compaction.call.active():
                compaction.call.cancel()
            compaction.abandon()
            compaction.notify(RuntimeError("the store was closed during compaction"))
        self.file.close()
        return succeed(None)


# The keys of ``broker.jsonl`` (see relay.rules.config.Setting); the section is read at start.
SETTINGS = (
    Setting("broker.jsonl", "sync", "sync", "choice", choices=SYNC_LEVELS, restart=True,
            default_from="sync"),
    Setting("broker.jsonl", "compactMinRecords", "compact_min_records", "int",
            COMPACT_MIN_RECORDS, 100, 2**31 - 1, restart=True),
)


@dataclass(frozen=True)
class JsonlOptions:
    """``broker.jsonl``: ``sync``, and ``compactMinRecords``, the fewest records a log
    holds before it may be compacted."""

    sync: str
    compact_min_records: int


def parse_options(section: Mapping[str, Any], config: Config) -> JsonlOptions:
    """Validate ``broker.jsonl`` (the IStoreFactory entry point)."""
    check_keys(section, "broker.jsonl", table_keys(SETTINGS), frozenset())
    values = read_settings(SETTINGS, section, config=config)
    return JsonlOptions(sync=values["sync"],
                        compact_min_records=values["compact_min_records"])


def open_store(config: Config, options: JsonlOptions, reactor: IReactorTime) -> JsonlStore:
    """Replay ``dataDir/messages.jsonl`` and open it for appending (the factory entry
    point). ``reactor`` times the group commits and compactions, and runs a
    compaction's fsync in its thread pool when it provides ``IReactorThreads``."""
    data_dir = make_data_dir(config.data_dir)
    path = os.path.join(data_dir, LOG_NAME)
    try:
        if os.path.exists(path + COMPACT_SUFFIX):
            os.unlink(path + COMPACT_SUFFIX)  # an unfinished compaction; the log is whole
        loaded = read_log(path, reactor.seconds()) if os.path.exists(path) else LoadedLog()
        if not loaded.ends_with_newline:  # a write torn by a crash: never acknowledged
            os.truncate(path, loaded.whole_bytes)
        private_file(path)
        file = open(path, "ab", buffering=0)  # noqa: SIM115 (the store's log)
    except OSError as e:
        raise ConfigError("broker.dataDir", f"cannot open {path}: {e.strerror}") from None
    store = JsonlStore(path, file, reactor, options.sync, loaded.records + loaded.skipped)
    store.compact_min_records = options.compact_min_records
    _restore(store, loaded)
    if loaded.records or loaded.skipped:
        log.info(
            "loaded {count} messages and {peers} peers from {path} "
            "({records} records, {skipped} unreadable lines skipped)",
            count=len(loaded.messages), peers=len(loaded.peers), path=path,
            records=loaded.records, skipped=loaded.skipped,
        )
    return store


def _restore(store: JsonlStore, loaded: LoadedLog) -> None:
    state = store.records
    for message in loaded.messages:
        state.load(message)
    state.peer_seen.update(loaded.peers)
    state.cards.update(loaded.cards)
    for agent, card in loaded.cards.items():
        state.joins.set_card(agent, card)
    state.next_seq = max(state.next_seq, loaded.next_seq)
    for event in loaded.events:
        state.load_event(event)
    state.event_floor = loaded.event_floor
    state.event_anchors.update(loaded.event_anchors)
    # None for a log whose events were trimmed without anchors: its floor holds
    state.events_anchored_from = loaded.events_anchored_from
    state.hooks.update(loaded.hooks)
    state.last_event = max(state.last_event, loaded.last_event, loaded.event_floor)


__all__ = ["JsonlStore", "LoadedLog", "open_store", "read_log", "snapshot_record"]

"""What each ``relay mcp`` tool does, for one agent, on the Twisted reactor.

:class:`RelayTools` is one MCP session's relay side: it handshakes and
registers the agent (with its peer card), heartbeats while the session lives,
keeps the messages it handed to the model leased (renewing them) until the
model settles them, and gives back what is still held when the session ends.
Every tool is one method returning a small JSON-ready dict; :meth:`RelayTools.call`
runs one by name within a deadline and turns every failure into a
:class:`ToolFailure` (a code and a message, never a traceback).

Everything here runs in the reactor thread and knows nothing of MCP or asyncio
(:mod:`relay.mcp.bridge` carries calls over). Message bodies are never logged
nor put in an error: notes and failures name ids, agents and codes.

What other agents wrote (message bodies, the names of senders, peer cards and
names, the errors of rejects and cancels) reaches the model only inside a field
named :data:`UNTRUSTED`: data from other parties, never the tool's own words.
"""

from __future__ import annotations

import inspect
import re
import uuid
from dataclasses import dataclass
from typing import (
    Any,
    Awaitable,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
)

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall, deferLater

from relay.client.client import (
    RelayClient,
    RequestFailed,
    RequestTimeout,
    ack_outcomes,
    answers_request,
    broker_notice,
    question_body,
)
from relay.wire.errors import RelayError
from relay.wire.protocol import (
    GROUP_PREFIX,
    KEEP_CARD,
    MAX_PRIORITY,
    ROLE_PREFIX,
    is_selfcheck_agent,
)

# The longest a tool may wait for a message or an answer: MCP clients give a
# tool call a minute or less, and a call also needs time for its requests.
MAX_WAIT_SECONDS = 20
# What a tool call may take beyond its wait (requests, retries) before it is
# cancelled and reported as a timeout; wait + this stays under 60 s.
CALL_GRACE_SECONDS = 25.0
# The lease of a message handed to the model: renewed every third of it while
# the session lives, so a session that dies without releasing (killed) holds a
# message at most this long.
LEASE_SECONDS = 60
HEARTBEAT_INTERVAL_SECONDS = 30.0  # the broker's heartbeat TTL is 90 s
# Without long polling, how often an inbox wait looks again.
POLL_SECONDS = 2.0
# How long the end of a session may spend giving leases back.
RELEASE_SECONDS = 5.0
INBOX_LIMIT = 10
MAX_INBOX_LIMIT = 50
# Answers to renewals and acknowledgements that mean the lease is gone.
LEASE_GONE = frozenset({404, 409})
# The field of a result that holds what other agents wrote, and only that.
UNTRUSTED = "untrusted"
INBOX_NOTE = (
    "Each message stays leased to you until relay_reply (answer it), relay_done, "
    "relay_release (give it back) or relay_reject (it can never succeed)."
)


class ToolFailure(Exception):
    """A tool call that did not happen: bad arguments or the broker's refusal.

    :attr:`code` is the broker's error code (``not_leased``, ``no_such_agent``,
    ...) or one of this module's (``bad_arguments``, ``not_held``, ``timeout``,
    ``stopped``); :attr:`message` says what went wrong without any message body.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def document(self) -> Dict[str, Any]:
        """The failure as the JSON a model reads: ``{"error": {"code", "message"}}``."""
        return {"error": {"code": self.code, "message": self.message}}


def failure_of(error: BaseException, deadline: float) -> ToolFailure:
    """The :class:`ToolFailure` for whatever a tool call raised."""
    if isinstance(error, ToolFailure):
        return error
    if isinstance(error, RelayError):
        return ToolFailure(error.code, error.message)
    if isinstance(error, defer.TimeoutError):
        return ToolFailure("timeout", f"the broker did not answer within {deadline:g} s")
    if isinstance(error, defer.CancelledError):
        return ToolFailure("stopped", "the call was cancelled: the relay session is ending")
    return ToolFailure("internal_error", f"the tool failed ({error.__class__.__name__})")


def body_of(text: Optional[str], body: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The message body of a tool call: ``{"text": text}``, or ``body`` as given.

    Exactly one of the two must be given.
    """
    if text is not None and body is not None:
        raise ToolFailure("bad_arguments", "give text or body, not both")
    if body is not None:
        if not isinstance(body, Mapping):
            raise ToolFailure("bad_arguments", "body must be a JSON object")
        return dict(body)
    if text is None:
        raise ToolFailure("bad_arguments", "give text (a string) or body (a JSON object)")
    return {"text": text}


def _wait(wait_seconds: Any) -> float:
    if isinstance(wait_seconds, bool) or not isinstance(wait_seconds, (int, float)):
        raise ToolFailure("bad_arguments", "wait_seconds must be a number")
    if not 0 <= wait_seconds <= MAX_WAIT_SECONDS:
        raise ToolFailure("bad_arguments", f"wait_seconds must be 0 to {MAX_WAIT_SECONDS}")
    return float(wait_seconds)


def _snake(key: str) -> str:
    return re.sub(r"(?<=[a-z])([A-Z])", lambda m: "_" + m.group(1).lower(), key)


def untrusted(**fields: Any) -> Dict[str, Any]:
    """``{UNTRUSTED: fields}``, the fields that are not None: what other agents wrote."""
    return {UNTRUSTED: {name: value for name, value in fields.items() if value is not None}}


def message_view(message: Mapping[str, Any], *, with_state: bool = False) -> Dict[str, Any]:
    """A message as a model needs it: what kind, which conversation, and, under
    :data:`UNTRUSTED`, who sent it and its body (or a failure notice's error)."""
    view: Dict[str, Any] = {"id": message.get("id")}
    view["kind"] = "receipt" if message.get("type") == "ack" else message.get("kind") or "message"
    parent = message.get("parentId") or message.get("replyTo")
    if parent:
        view["parent_id"] = parent
    root = message.get("rootId")
    if root and root != message.get("id") and root != parent:
        view["root_id"] = root
    if message.get("via"):
        view["via"] = message.get("via")  # a copy of a send to a group (REACH §13)
    if with_state and message.get("status"):
        view["status"] = message.get("status")
    recipient = message.get("to")
    if isinstance(recipient, str) and recipient.startswith(ROLE_PREFIX):
        view["role"] = recipient[len(ROLE_PREFIX):]  # a name from the operator's config
    if message.get("priority"):
        view["priority"] = message.get("priority")
    view["ts"] = message.get("ts")
    to = message.get("to") if with_state else None
    notice = broker_notice(message)
    if notice is not None:
        view["failed"] = True
        view["event"] = notice.get("event")
        view.update(untrusted(**{"from": message.get("from")}, to=to, error=notice.get("error")))
    else:
        view.update(untrusted(**{"from": message.get("from")}, to=to, body=message.get("body")))
    return view


def _messages(answer: Any) -> List[Dict[str, Any]]:
    listed = answer.get("messages") if isinstance(answer, dict) else None
    return [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []


@dataclass
class _Held:
    """A message handed to the model and not settled yet."""

    lease_id: str
    sender: str
    root_id: str
    receipt: bool  # the sender asked for a v1.0 receipt
    lease_seconds: Optional[int]


class RelayTools:
    """The relay side of one MCP session, as the agent of ``client``.

    :param client: the agent's client; its agent name is the only identity
        the tools act as.
    :param clock: the reactor's time (a ``Clock`` in tests).
    :param card: the peer card to register with (``{"description", "skills"}``),
        or None to keep the one the broker has.
    :param note: called with one line about the session (renewals lost,
        heartbeats failing); never with a message body.
    """

    def __init__(
        self,
        client: RelayClient,
        clock: IReactorTime,
        *,
        card: Optional[Mapping[str, Any]] = None,
        note: Optional[Callable[[str], None]] = None,
        lease_seconds: int = LEASE_SECONDS,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_SECONDS,
    ) -> None:
        self.client = client
        self.clock = clock
        self.card = dict(card) if card is not None else None
        self.note = note or (lambda line: None)
        self.lease_seconds = lease_seconds
        self.heartbeat_interval = heartbeat_interval
        self.held: Dict[str, _Held] = {}
        # requests this session sent, not answered yet -> the agent asked
        self.pending: Dict[str, str] = {}
        self._answers: Dict[str, Dict[str, Any]] = {}  # request id -> its result
        self._calls: Set[defer.Deferred] = set()
        self._loops: List[LoopingCall] = []
        self._started = False
        self._stopped = False
        self._tools: Dict[str, Callable[..., Awaitable[Dict[str, Any]]]] = {
            "relay_whoami": self.whoami,
            "relay_peers": self.peers,
            "relay_send": self.send,
            "relay_request": self.request,
            "relay_wait_reply": self.wait_reply,
            "relay_ask_human": self.ask_human,
            "relay_inbox": self.inbox,
            "relay_reply": self.reply,
            "relay_done": self.done,
            "relay_release": self.release,
            "relay_reject": self.reject,
            "relay_renew": self.renew,
            "relay_status": self.status,
            "relay_thread": self.thread,
        }

    @property
    def agent(self) -> str:
        """The agent this session acts as."""
        return self.client.agent

    @property
    def tool_names(self) -> Sequence[str]:
        """The names :meth:`call` takes."""
        return tuple(self._tools)

    # -- the session --------------------------------------------------------------

    async def start(self) -> Dict[str, Any]:
        """Handshake (a protocol mismatch raises ``RelayError``), register with the
        card, then heartbeat and renew held leases until :meth:`stop`; the
        broker's ``GET /`` document."""
        info = await self.client.handshake()
        card: Any = KEEP_CARD
        if self.card is not None:
            if self.client.advertises("peerCards"):
                card = self.card
            else:
                self.note("the broker lacks peerCards: the peer card is not published")
        await self.client.register(card=card)
        self._started = True
        self._loop(self._beat, self.heartbeat_interval)
        if self.client.advertises("leaseRenew"):
            self._loop(self._renew_held, self.lease_seconds / 3.0)
        return info

    def _loop(self, function: Callable[[], Awaitable[None]], interval: float) -> None:
        loop = LoopingCall(lambda: defer.ensureDeferred(function()))
        loop.clock = self.clock
        loop.start(interval, now=False)
        self._loops.append(loop)

    async def _beat(self) -> None:
        try:
            await self.client.register()
        except RelayError as error:
            self.note(f"heartbeat failed ({error.code}); next in {self.heartbeat_interval:g} s")

    async def _renew_held(self) -> None:
        for message_id, held in list(self.held.items()):
            try:
                await self.client.renew(message_id, held.lease_id, held.lease_seconds)
            except RelayError as error:
                if error.status in LEASE_GONE:
                    self._forget(message_id, held.lease_id)
                    self.note(f"the lease of message {message_id} is gone ({error.code})")
                else:
                    self.note(f"renewing the lease of message {message_id} failed ({error.code})")

    def _forget(self, message_id: str, lease_id: str) -> None:
        held = self.held.get(message_id)
        if held is not None and held.lease_id == lease_id:
            del self.held[message_id]

    async def stop(self) -> int:
        """End the session: stop heartbeats and renewals, cancel running calls, and
        release every message still held, so it goes back to the queue now
        (within :data:`RELEASE_SECONDS`). The number of messages released."""
        if self._stopped:
            return 0
        self._stopped = True
        for loop in self._loops:
            if loop.running:
                loop.stop()
        for call in list(self._calls):
            call.cancel()
        held, self.held = dict(self.held), {}
        if not held:
            return 0
        if "release" not in ack_outcomes(self.client.info):
            self.note(f"the broker cannot release: {len(held)} held messages wait out their lease")
            return 0
        releases = [
            defer.ensureDeferred(self._release_quietly(message_id, entry.lease_id))
            for message_id, entry in held.items()
        ]
        everything = defer.DeferredList(releases, consumeErrors=True)
        everything.addTimeout(RELEASE_SECONDS, self.clock)
        try:
            results = await everything
        except defer.TimeoutError:
            self.note("giving the held messages back took too long; the rest wait out their lease")
            return 0
        released = sum(1 for ok, value in results if ok and value)
        self.note(f"session ended: released {released} of {len(held)} held messages")
        return released

    async def _release_quietly(self, message_id: str, lease_id: str) -> bool:
        try:
            await self.client.release(message_id, lease_id)
        except RelayError as error:
            self.note(f"releasing message {message_id} failed ({error.code})")
            return False
        return True

    # -- calling a tool -------------------------------------------------------------

    def call(self, name: str, arguments: Mapping[str, Any]) -> defer.Deferred:
        """Run the tool ``name``: a Deferred firing with its result (a dict), or
        failing with a :class:`ToolFailure` only.

        The call is cancelled, and fails with code ``timeout``, when it takes
        more than its wait (``wait_seconds``) and :data:`CALL_GRACE_SECONDS`.
        """
        tool = self._tools.get(name)
        if tool is None:
            return defer.fail(ToolFailure("bad_arguments", f"no tool {name!r}"))
        if self._stopped or not self._started:
            return defer.fail(ToolFailure("stopped", "the relay session is not running"))
        wait = arguments.get("wait_seconds")
        deadline = CALL_GRACE_SECONDS + (
            float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool) else 0.0
        )

        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as error:
            return defer.fail(ToolFailure("bad_arguments", f"{name}: {error}"))
        d = defer.ensureDeferred(tool(**arguments))
        self._calls.add(d)
        d.addTimeout(deadline, self.clock)

        def finished(result: Any) -> Any:
            self._calls.discard(d)
            return result

        def failed(failure: Any) -> None:
            raise failure_of(failure.value, deadline)

        d.addBoth(finished)
        d.addErrback(failed)
        return d

    # -- who and where --------------------------------------------------------------

    async def whoami(self) -> Dict[str, Any]:
        """This agent, its broker, and what the session holds and waits for."""
        info = self.client.info or {}
        extensions = sorted(name for name, value in self.client.capabilities.items() if value)
        return {
            "agent": self.agent,
            "broker_url": self.client.broker_url,
            "broker": info.get("broker"),
            "broker_version": info.get("version"),
            "protocol": info.get("protocol"),
            "capabilities": extensions,
            "held": sorted(self.held),
            "waiting_for": sorted(self.pending),
        }

    async def peers(self, after: Optional[str] = None) -> Dict[str, Any]:
        """The registered agents, online or not, with their cards: one page of the
        broker's answer, and ``next`` (for ``after``) when more follow."""
        answer = await self.client.peers(after=after)
        listed = []
        for peer in answer.get("peers") or []:
            if not isinstance(peer, dict):
                continue
            name = str(peer.get("agent"))
            if is_selfcheck_agent(name) and not peer.get("online"):
                continue
            written: Dict[str, Any] = {"agent": name}
            card = peer.get("card")
            if isinstance(card, dict):
                written["description"] = card.get("description") or None
                written["skills"] = card.get("skills") or None
            entry: Dict[str, Any] = {
                "online": bool(peer.get("online")),
                "last_seen": peer.get("lastSeen"),
            }
            if name == self.agent:
                entry["you"] = True
            if peer.get("human") is True:  # set by the operator's config (REACH §15)
                entry["human"] = True
            entry.update(untrusted(**written))
            listed.append(entry)
        result: Dict[str, Any] = {"peers": listed, "count": len(listed)}
        # REACH §13: the operator's teams (from the broker's config), addressed as
        # "group:NAME" / "role:NAME"
        for key in ("groups", "roles"):
            teams = answer.get(key)
            if isinstance(teams, list):
                result[key] = [{"name": t.get("name"), "members": t.get("members")}
                               for t in teams if isinstance(t, dict)]
        following = answer.get("next")
        if isinstance(following, str):
            result["next"] = following
        return result

    # -- asking ---------------------------------------------------------------------

    async def send(
        self,
        to: str,
        text: Optional[str] = None,
        body: Optional[Mapping[str, Any]] = None,
        kind: str = "message",
        priority: int = 0,
    ) -> Dict[str, Any]:
        """Send a message (or a request, answered later) to ``to`` (an agent, or
        ``role:NAME``: whichever member of the role takes it), with a ``priority``
        0..9 (REACH §14)."""
        content = body_of(text, body)
        if kind not in ("message", "request"):
            raise ToolFailure("bad_arguments", 'kind must be "message" or "request"')
        if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
            raise ToolFailure("bad_arguments", f"priority must be 0 to {MAX_PRIORITY}")
        message_id = str(uuid.uuid4())
        answer = await self.client.send(to, content, message_id=message_id, kind=kind,
                                        priority=priority or None)
        result: Dict[str, Any] = {
            "sent": True,
            "id": answer.get("id", message_id),
            "to": to,
            "kind": kind,
        }
        copies = answer.get("copies")
        if isinstance(copies, list):
            # REACH §13: a copy per member, each its own message (and request)
            result["copies"] = [{"to": c.get("to"), "id": c.get("id")}
                                for c in copies if isinstance(c, dict)]
            if kind == "request":
                for copy in result["copies"]:
                    self.pending[copy["id"]] = copy["to"]
                result["next"] = ("each member answers its own copy: relay_wait_reply with a "
                                  "copy's id as request_id waits for that member's answer")
            return result
        if kind == "request":
            self.pending[result["id"]] = to
            result["next"] = "relay_wait_reply with this id as request_id waits for the answer"
        return result

    async def request(
        self,
        to: str,
        text: Optional[str] = None,
        body: Optional[Mapping[str, Any]] = None,
        wait_seconds: float = MAX_WAIT_SECONDS,
    ) -> Dict[str, Any]:
        """Send a request to ``to`` and wait up to ``wait_seconds`` for its answer."""
        content = body_of(text, body)
        wait = _wait(wait_seconds)
        if to.startswith(GROUP_PREFIX):
            raise ToolFailure("bad_arguments", "relay_request waits for one answer: to ask a "
                              'group, use relay_send with kind "request", then '
                              "relay_wait_reply for each copy")
        request_id = str(uuid.uuid4())
        await self.client.send(to, content, message_id=request_id, kind="request")
        self.pending[request_id] = to
        return await self._await(request_id, to, wait)

    async def ask_human(
        self,
        to: str,
        question: str,
        options: Optional[Sequence[str]] = None,
        wait_seconds: float = MAX_WAIT_SECONDS,
    ) -> Dict[str, Any]:
        """Ask the person ``to`` (REACH §15) ``question``, offering ``options``, and
        wait up to ``wait_seconds`` for the answer, as :meth:`request` does."""
        try:
            content = question_body(question, options)
        except ValueError as error:
            raise ToolFailure("bad_arguments", str(error)) from None
        wait = _wait(wait_seconds)
        request_id = str(uuid.uuid4())
        await self.client.send(to, content, message_id=request_id, kind="request")
        self.pending[request_id] = to
        return await self._await(request_id, to, wait)

    async def wait_reply(
        self, request_id: str, wait_seconds: float = MAX_WAIT_SECONDS
    ) -> Dict[str, Any]:
        """Wait up to ``wait_seconds`` more for the answer to a request sent before."""
        wait = _wait(wait_seconds)
        if request_id in self._answers:
            return self._answered(request_id)
        states = _messages(await self.client.status([request_id]))
        entry = next((s for s in states if s.get("id") == request_id), None)
        gone = entry is None or entry.get("status") == "not_found"
        if not gone and entry.get("from") != self.agent:
            raise ToolFailure("forbidden", f"request {request_id} was not sent by {self.agent}")
        if not gone and entry.get("kind") not in (None, "request"):
            raise ToolFailure("bad_arguments", f"{request_id} is a {entry.get('kind')}, not a "
                              "request: no answer comes to it")
        to = None if gone else entry.get("to")
        if to is not None and to.startswith(ROLE_PREFIX):
            to = entry.get("completedBy") or to  # a role's member answers (REACH §13)
        if gone or entry.get("status") in ("done", "failed"):
            # A request that expired (gone), failed or was answered: its answer or
            # failure notice may be waiting, or have been handed out already. Only
            # the recipient's reply and the broker's notice count (of a request
            # that is gone, only the notice: its recipient is not known any more).
            answers = [m for m in await self._answers_on_record(request_id)
                       if answers_request(m, request_id, to)]
            if any(m.get("status") in ("queued", "leased") for m in answers):
                return await self._await(request_id, to, wait)
            if answers:
                self.pending.pop(request_id, None)
                return {**_answer_result(request_id, answers[0]), "handed_out_before": True}
            if gone:
                raise ToolFailure(
                    "no_such_message", f"no request {request_id} (unknown, or expired and gone)"
                )
        return await self._await(request_id, to, wait)

    async def _answers_on_record(self, request_id: str) -> List[Dict[str, Any]]:
        """The messages in this agent's inbox answering ``request_id`` (replies and its
        failure notice), newest first; none where the broker cannot search by parent."""
        if not self.client.advertises("threads"):
            return []
        found = await self.client.query(box="inbox", parent_id=request_id, limit=10)
        return [m for m in _messages(found) if m.get("to") == self.agent]

    async def _await(self, request_id: str, to: Optional[str], wait: float) -> Dict[str, Any]:
        try:
            answer = await self.client.await_reply(request_id, wait, to=to)
        except RequestFailed as failed:
            self.pending.pop(request_id, None)
            return {
                "answered": False,
                "failed": True,
                "request_id": request_id,
                "to": to or failed.to,
                "event": failed.event,
                **untrusted(error=failed.error),
            }
        except RequestTimeout:
            if request_id in self._answers:  # relay_inbox took the answer meanwhile
                return self._answered(request_id)
            return {
                "answered": False,
                "request_id": request_id,
                "to": to,
                "next": f"no answer within {wait:g} s; relay_wait_reply with this "
                "request_id waits longer",
            }
        self.pending.pop(request_id, None)
        return _answer_result(request_id, answer)

    def _answered(self, request_id: str) -> Dict[str, Any]:
        self.pending.pop(request_id, None)
        return self._answers.pop(request_id)

    # -- the inbox ------------------------------------------------------------------

    async def inbox(
        self, wait_seconds: float = MAX_WAIT_SECONDS, limit: int = INBOX_LIMIT,
        role: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Lease new messages (from this agent's inbox and its roles' queues, urgent
        first; with ``role``, from that role's queue alone), waiting up to
        ``wait_seconds`` for the first."""
        wait = _wait(wait_seconds)
        if type(limit) is not int or not 0 < limit <= MAX_INBOX_LIMIT:
            raise ToolFailure("bad_arguments", f"limit must be 1 to {MAX_INBOX_LIMIT}")
        if role is not None and (not isinstance(role, str) or not role):
            raise ToolFailure("bad_arguments", "role must be a role name")
        renewing = self.client.advertises("leaseRenew")
        lease_seconds = self.lease_seconds if renewing else None
        long_poll = self.client.long_poll_seconds is not None
        deadline = self.clock.seconds() + wait
        while True:
            remaining = deadline - self.clock.seconds()
            waited = remaining if long_poll and remaining >= 1 else None
            leased = _messages(
                await self.client.pull(limit=limit, lease_seconds=lease_seconds, wait=waited,
                                       role=role)
            )
            if leased:
                break
            remaining = deadline - self.clock.seconds()
            if remaining <= 0:
                break
            if waited is None:
                await deferLater(self.clock, min(POLL_SECONDS, remaining))
        shown = [await self._take(message, lease_seconds) for message in leased]
        result: Dict[str, Any] = {"messages": shown, "count": len(shown)}
        if self.held:
            result["held"] = len(self.held)
        if any(view.get("kind") in ("message", "request") for view in shown):
            result["note"] = INBOX_NOTE
        return result

    async def _take(self, message: Dict[str, Any], lease_seconds: Optional[int]) -> Dict[str, Any]:
        """A leased message as the model sees it; answers and receipts are settled
        here (nothing answers them), requests and messages are held."""
        view = message_view(message)
        message_id = str(message.get("id"))
        lease_id = str(message.get("leaseId") or "")
        if view["kind"] in ("reply", "receipt"):
            try:
                await self.client.complete(message_id, lease_id)
            except RelayError as error:
                self.note(f"the answer {message_id} was read but not acknowledged ({error.code})")
            parent = view.get("parent_id")
            if (view["kind"] == "reply" and parent in self.pending
                    and answers_request(message, parent,
                                        await self.client.answerer(parent, self.pending[parent]))):
                self._answers[parent] = _answer_result(parent, message)
                view["answers_request"] = parent
            return view
        self.held[message_id] = _Held(
            lease_id=lease_id,
            sender=str(message.get("from")),
            root_id=str(message.get("rootId") or message_id),
            receipt=bool(message.get("ack")),
            lease_seconds=lease_seconds,
        )
        return view

    # -- settling a held message ----------------------------------------------------

    def _held(self, message_id: str) -> _Held:
        held = self.held.get(message_id)
        if held is None:
            raise ToolFailure(
                "not_held",
                f"message {message_id} is not leased to this session: relay_inbox hands "
                "messages out, and each is settled once",
            )
        return held

    async def _settle(self, message_id: str, held: _Held, action: Awaitable[Any]) -> Any:
        """Await ``action`` on a held message; a refusal meaning the lease is gone
        forgets it."""
        try:
            answer = await action
        except RelayError as error:
            if error.status in LEASE_GONE:
                self._forget(message_id, held.lease_id)
            raise
        self._forget(message_id, held.lease_id)
        return answer

    async def _receipt(self, message_id: str, held: _Held) -> None:
        if not held.receipt:
            return
        try:
            await self.client.ack(message_id, "ok")
        except RelayError as error:
            self.note(f"the receipt of message {message_id} was not sent ({error.code})")

    async def reply(
        self,
        message_id: str,
        text: Optional[str] = None,
        body: Optional[Mapping[str, Any]] = None,
    ) -> Dict[str, Any]:
        """Answer a held message and complete it, in one step where the broker can."""
        content = body_of(text, body)
        held = self._held(message_id)
        if self.client.advertises("replyInAck"):
            answer = await self._settle(
                message_id,
                held,
                self.client.complete(message_id, held.lease_id, reply={"body": content}),
            )
            reply_id = answer.get("replyId")
        else:
            reply_id = str(uuid.uuid4())
            await self.client.send(
                held.sender,
                content,
                message_id=reply_id,
                kind="reply",
                reply_to=message_id,
                parent_id=message_id,
                root_id=held.root_id,
            )
            await self._settle(message_id, held, self.client.complete(message_id, held.lease_id))
        await self._receipt(message_id, held)
        return {"replied": True, "message_id": message_id, "reply_id": reply_id, "to": held.sender}

    async def done(self, message_id: str) -> Dict[str, Any]:
        """Complete a held message that needs no reply."""
        held = self._held(message_id)
        await self._settle(message_id, held, self.client.complete(message_id, held.lease_id))
        await self._receipt(message_id, held)
        return {"done": True, "message_id": message_id}

    async def release(
        self, message_id: str, after_seconds: Optional[int] = None
    ) -> Dict[str, Any]:
        """Give a held message back to the queue without using an attempt."""
        held = self._held(message_id)
        await self._settle(
            message_id, held, self.client.release(message_id, held.lease_id, after=after_seconds)
        )
        return {"released": True, "message_id": message_id}

    async def reject(self, message_id: str, reason: str) -> Dict[str, Any]:
        """Fail a held message at once: it can never succeed."""
        held = self._held(message_id)
        answer = await self._settle(
            message_id, held, self.client.reject(message_id, held.lease_id, reason)
        )
        return {"rejected": True, "message_id": message_id, "status": answer.get("status")}

    async def renew(
        self, message_id: str, lease_seconds: Optional[int] = None
    ) -> Dict[str, Any]:
        """Extend the lease of a held message (the session renews held leases
        anyway; this sets a longer lease for when it cannot)."""
        held = self._held(message_id)
        try:
            answer = await self.client.renew(message_id, held.lease_id, lease_seconds)
        except RelayError as error:
            if error.status in LEASE_GONE:
                self._forget(message_id, held.lease_id)
            raise
        if lease_seconds is not None:
            held.lease_seconds = max(lease_seconds, held.lease_seconds or 0)
        return {"renewed": True, "message_id": message_id, "lease_until": answer.get("leaseUntil")}

    # -- looking --------------------------------------------------------------------

    async def status(self, ids: Sequence[str]) -> Dict[str, Any]:
        """The delivery state of messages this agent sent or received."""
        if not ids:
            raise ToolFailure("bad_arguments", "ids must list at least one message id")
        answer = await self.client.status(list(ids))
        return {"messages": [_status_view(entry) for entry in _messages(answer)]}

    async def thread(
        self, root_id: str, since: Optional[str] = None, limit: Optional[int] = None
    ) -> Dict[str, Any]:
        """One conversation, oldest first, as far as this agent took part in it."""
        answer = await self.client.thread(root_id, since=since, limit=limit)
        shown = [message_view(m, with_state=True) for m in _messages(answer)]
        return {"root_id": root_id, "messages": shown, "cursor": answer.get("cursor")}


def _status_view(entry: Mapping[str, Any]) -> Dict[str, Any]:
    """A ``/v1/status`` entry as the model sees it: the agents and the error (which
    the recipient's reject or the sender's cancel wrote) under :data:`UNTRUSTED`."""
    written = {key: entry.get(key) for key in ("from", "to", "error")}
    view = {_snake(key): value for key, value in entry.items() if key not in written}
    view.update(untrusted(**written))
    return view


def _answer_result(request_id: str, answer: Mapping[str, Any]) -> Dict[str, Any]:
    """The result of a request whose answer (or failure notice) is ``answer``."""
    notice = broker_notice(answer, request_id)
    if notice is not None:
        return {
            "answered": False,
            "failed": True,
            "request_id": request_id,
            "to": answer.get("from"),
            "event": notice.get("event"),
            **untrusted(error=notice.get("error")),
        }
    return {
        "answered": True,
        "request_id": request_id,
        "reply_id": answer.get("id"),
        **untrusted(**{"from": answer.get("from")}, body=answer.get("body")),
    }

"""A tiny in-memory stand-in broker, only for checking the load generator itself.

It implements just what the benchmark scenarios use (``GET /``, ``POST /register``,
``POST /messages``, ``GET /messages``, ``POST /v1/pull`` with ``waitSeconds``,
``POST /v1/ack``) with HMAC verification, so loadgen changes can be tried without the
real broker. It is not the relay and its figures mean nothing about the relay.

    python bench/standin.py --port 19299 --secret s3cret
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import sys
import time
import uuid
from collections import OrderedDict, deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Set

from twisted.internet import defer, reactor
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

JsonDict = Dict[str, Any]


class Standin(Resource):
    """All routes in one leaf resource; state lives in plain dicts."""

    isLeaf = True

    def __init__(self, secret: str) -> None:
        super().__init__()
        self.key = secret.encode()
        self.peers: Set[str] = set()
        self.messages: OrderedDict[str, JsonDict] = OrderedDict()
        self.queues: Dict[str, Deque[str]] = {}
        self.waiters: Dict[str, List[defer.Deferred]] = {}

    def _reply(self, request: Any, code: int, doc: JsonDict) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        return json.dumps(doc).encode()

    def _error(self, request: Any, code: int, name: str) -> bytes:
        return self._reply(request, code, {"error": {"code": name, "message": name}})

    def render(self, request: Any) -> Any:
        method = request.method.decode()
        path = request.uri.decode()
        route = request.path.decode()
        if method == "GET" and route == "/":
            return self._reply(request, 200, {
                "protocol": "1.0", "broker": "bench-standin", "version": "0.0",
                "capabilities": {"leaseDelivery": True, "longPoll": {"maxWaitSeconds": 20}},
                "storage": "memory"})
        body = request.content.read()
        agent = (request.getHeader("x-relay-agent") or "")
        ts = request.getHeader("x-relay-timestamp") or ""
        sig = request.getHeader("x-relay-signature") or ""
        msg = f"{method}\n{path}\n{ts}\n".encode() + body
        good = hmac.new(self.key, msg, hashlib.sha256).hexdigest()
        if not agent or not ts or abs(time.time() - int(ts)) > 300 or \
                not hmac.compare_digest(good, sig):
            return self._error(request, 401, "unauthenticated")
        doc = json.loads(body) if body else {}
        if method == "POST" and route == "/register":
            self.peers.add(agent)
            return self._reply(request, 200, {"ok": True, "agent": agent, "ts": int(time.time())})
        if method == "POST" and route == "/messages":
            return self._send(request, agent, doc)
        if method == "GET" and route == "/messages":
            return self._poll(request, agent)
        if method == "POST" and route == "/v1/pull":
            return self._pull(request, agent, doc)
        if method == "POST" and route == "/v1/ack":
            return self._ack(request, agent, doc)
        return self._error(request, 404, "not_found")

    def _send(self, request: Any, agent: str, doc: JsonDict) -> bytes:
        to = doc.get("to")
        if to not in self.peers:
            return self._error(request, 404, "no_such_agent")
        mid = doc.get("id") or str(uuid.uuid4())
        if mid in self.messages:
            return self._reply(request, 200, {"accepted": True, "id": mid, "duplicate": True})
        env = {"id": mid, "from": agent, "to": to, "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
               "type": "message", "body": doc.get("body") or {}, "replyTo": None,
               "ack": False, "status": "queued", "attempts": 0}
        self.messages[mid] = env
        self.queues.setdefault(to, deque()).append(mid)
        waiters = self.waiters.get(to)
        if waiters:
            waiters.pop(0).callback(None)
        return self._reply(request, 201, {"accepted": True, "id": mid, "duplicate": False})

    def _poll(self, request: Any, agent: str) -> bytes:
        args = request.args
        since = (args.get(b"since") or [b""])[0].decode()
        limit = int((args.get(b"limit") or [b"50"])[0])
        out: List[JsonDict] = []
        after = not since or since not in self.messages
        for mid, env in self.messages.items():
            if not after:
                after = mid == since
                continue
            if env["to"] == agent and env["status"] == "queued":
                out.append(env)
                if len(out) >= limit:
                    break
        return self._reply(request, 200, {"messages": out,
                                          "cursor": out[-1]["id"] if out else since or None})

    def _lease(self, agent: str, limit: int) -> List[JsonDict]:
        queue = self.queues.get(agent) or deque()
        out: List[JsonDict] = []
        while queue and len(out) < limit:
            env = self.messages[queue.popleft()]
            env["status"] = "leased"
            env["leaseId"] = uuid.uuid4().hex
            out.append(env)
        return out

    def _pull(self, request: Any, agent: str, doc: JsonDict) -> Any:
        limit = int(doc.get("limit") or 10)
        wait = int(doc.get("waitSeconds") or 0)
        out = self._lease(agent, limit)
        if out or wait <= 0:
            return self._reply(request, 200, {"messages": out, "count": len(out)})
        d: defer.Deferred = defer.Deferred()
        self.waiters.setdefault(agent, []).append(d)
        timer = reactor.callLater(wait, lambda: d.called or d.callback(None))  # type: ignore

        def done(_: Any) -> None:
            if timer.active():
                timer.cancel()
            if d in self.waiters.get(agent, []):
                self.waiters[agent].remove(d)
            got = self._lease(agent, limit)
            request.write(self._reply(request, 200, {"messages": got, "count": len(got)}))
            request.finish()

        d.addCallback(done)
        return NOT_DONE_YET

    def _ack(self, request: Any, agent: str, doc: JsonDict) -> bytes:
        env = self.messages.get(doc.get("messageId") or "")
        if env is None:
            return self._error(request, 404, "no_such_message")
        if env.get("status") != "leased":
            return self._error(request, 409, "not_leased")
        if env.get("leaseId") != doc.get("leaseId"):
            return self._error(request, 409, "lease_mismatch")
        env["status"] = "done"
        return self._reply(request, 200, {"ok": True, "status": "done", "attempts": 1})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve the stand-in on 127.0.0.1 until killed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=19299)
    parser.add_argument("--secret", required=True)
    args = parser.parse_args(argv)
    reactor.listenTCP(args.port, Site(Standin(args.secret)),  # type: ignore[attr-defined]
                      interface="127.0.0.1")
    print(f"stand-in broker on 127.0.0.1:{args.port}", flush=True)
    reactor.run()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())

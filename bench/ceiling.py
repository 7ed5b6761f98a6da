"""Framework ceilings: the fastest a bare twisted.web resource or Klein route can answer.

Each server answers ``POST /messages`` with the same small JSON document (the twisted.web
one answers any path), so the load generator's ``send`` scenario can be pointed at it
unchanged; the signature headers are ignored. Like the broker's own request class, the
request class here skips Twisted's form-body parsing (which runs the ``email`` package's
Content-Type parser on every POST), so the ceiling does no work the broker may skip.
The suite starts each one as a separate process with the same interpreter as the broker
and states broker figures as a fraction of the Klein one.

    python bench/ceiling.py --kind web   --port 19201
    python bench/ceiling.py --kind klein --port 19202
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

BODY = b'{"accepted":true,"id":"00000000-0000-4000-8000-000000000000","duplicate":false}'


def _site(resource: Any) -> Any:
    """A Site whose requests do not parse form bodies (bodies here are JSON)."""
    from twisted.web.server import Request, Site

    class JsonRequest(Request):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._parsePOSTFormSubmission = False

    site = Site(resource)
    site.requestFactory = JsonRequest
    return site


def web_site() -> Any:
    """A ``twisted.web`` Site whose single leaf resource answers every path."""
    from twisted.web.resource import Resource

    class Fixed(Resource):
        isLeaf = True

        def render(self, request: Any) -> bytes:
            request.setHeader(b"content-type", b"application/json; charset=utf-8")
            return BODY

    return _site(Fixed())


def klein_site() -> Any:
    """A Klein app with one route, ``POST /messages``, returning the fixed JSON."""
    from klein import Klein

    app = Klein()

    @app.route("/messages", methods=["POST"])
    def fixed(request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        return BODY

    return _site(app.resource())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve the chosen ceiling on 127.0.0.1 until killed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=["web", "klein"], required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    from twisted.internet import reactor

    site = web_site() if args.kind == "web" else klein_site()
    reactor.listenTCP(args.port, site, interface="127.0.0.1")  # type: ignore[attr-defined]
    print(f"ceiling {args.kind} listening on 127.0.0.1:{args.port}", flush=True)
    reactor.run()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Framework ceilings: the fastest a bare twisted.web resource or Klein route can answer.

Each server answers every request, whatever the method and path, with the same small
JSON document, so the load generator's ``send`` scenario can be pointed at it unchanged
(it ignores the signature headers). The suite starts each one as a separate process with
the same interpreter as the broker and states broker figures as a fraction of the Klein one.

    python bench/ceiling.py --kind web   --port 19201
    python bench/ceiling.py --kind klein --port 19202
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

BODY = b'{"accepted":true,"id":"00000000-0000-4000-8000-000000000000","duplicate":false}'


def web_site() -> Any:
    """A ``twisted.web`` Site whose single leaf resource answers every path."""
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    class Fixed(Resource):
        isLeaf = True

        def render(self, request: Any) -> bytes:
            request.setHeader(b"content-type", b"application/json; charset=utf-8")
            return BODY

    return Site(Fixed())


def klein_site() -> Any:
    """A Klein app with one catch-all route returning the fixed JSON."""
    from klein import Klein
    from twisted.web.server import Site

    app = Klein()

    @app.route("/", branch=True, methods=["GET", "POST"])
    def fixed(request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        return BODY

    return Site(app.resource())


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

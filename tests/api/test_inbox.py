"""``GET /inbox/`` (REACH §15): the static page of a person's inbox, unsigned, with its
strict headers, no other file, and nothing loaded from elsewhere.

In memory. The page itself runs in a real browser in tests/processes/browser_inbox.py;
``agents.<name>.human`` in config is tests/rules/test_config.py.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources

import pytest
import pytest_twisted

from relay.broker.inbox import CONTENT_SECURITY_POLICY
from tests.support.api import assert_error
from tests.support.teams import human_broker

STATIC = resources.files("relay.broker.inbox").joinpath("static")


PAGE_FILES = [("/inbox/", "index.html", "text/html; charset=utf-8"),
              ("/inbox/inbox.js", "inbox.js", "text/javascript; charset=utf-8"),
              ("/inbox/inbox.css", "inbox.css", "text/css; charset=utf-8"),
              ("/inbox/icon.svg", "icon.svg", "image/svg+xml")]


# -- v1.3 (REACH §15) ----------------------------------------------------------------------


@pytest.mark.parametrize("path, filename, content_type", PAGE_FILES)
@pytest_twisted.ensureDeferred
async def test_each_file_is_served_unsigned_with_the_strict_headers(path, filename,
                                                                    content_type):
    reply = await human_broker().get(None, path)
    body = STATIC.joinpath(filename).read_bytes()
    assert reply.code == 200 and reply.raw == body
    assert reply.header("content-type") == content_type
    assert reply.header("content-security-policy") == CONTENT_SECURITY_POLICY.decode()
    for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'",
                      "connect-src 'self'", "img-src 'self'", "base-uri 'none'",
                      "form-action 'none'", "frame-ancestors 'none'"):
        assert directive in reply.header("content-security-policy")
    assert reply.header("x-content-type-options") == "nosniff"
    assert reply.header("referrer-policy") == "no-referrer"
    assert reply.header("cache-control") == "no-cache"
    assert reply.header("etag") == f'"{hashlib.sha256(body).hexdigest()[:32]}"'


@pytest_twisted.ensureDeferred
async def test_an_unchanged_file_is_answered_304():
    broker = human_broker()
    first = await broker.get(None, "/inbox/inbox.js")
    again = await broker.get(None, "/inbox/inbox.js",
                             headers={"If-None-Match": first.header("etag")})
    assert again.code == 304 and again.raw == b""
    changed = await broker.get(None, "/inbox/inbox.js", headers={"If-None-Match": '"old"'})
    assert changed.code == 200 and changed.raw == first.raw


@pytest.mark.parametrize("path", [
    "/inbox/static/", "/inbox/static/inbox.js", "/inbox/nothing.js", "/inbox/../web.py",
    "/inbox/%2e%2e/__init__.py", "/inbox/__init__.py", "/inbox/inbox.js/", "/inbox//",
    "/inbox/index.html",
])
@pytest_twisted.ensureDeferred
async def test_no_listing_and_no_other_file(path):
    """Only the page's own files: no directory listing, no file of the package, the
    uniform §6 body for the rest (a ``//`` path is no route, as everywhere)."""
    reply = await human_broker().get(None, path)
    if path == "/inbox//":
        assert_error(reply, 401, "unauthenticated")
    else:
        assert_error(reply, 404, "not_found")
    assert b"<" not in reply.raw


@pytest_twisted.ensureDeferred
async def test_bare_inbox_redirects_to_the_page():
    reply = await human_broker().get(None, "/inbox")
    assert reply.code == 301 and reply.header("location") == "/inbox/"


@pytest_twisted.ensureDeferred
async def test_only_get_and_head_serve_the_page():
    broker = human_broker()
    head = await broker.request(None, "HEAD", "/inbox/")
    assert head.code == 200 and head.raw == b""
    posted = await broker.post(None, "/inbox/", {})
    assert posted.code in (401, 404) and posted.error_code in ("unauthenticated", "not_found")


@pytest_twisted.ensureDeferred
async def test_the_page_loads_nothing_from_elsewhere_and_runs_no_inline_script():
    reply = await human_broker().get(None, "/inbox/")
    page = reply.raw.decode("utf-8")
    scripts = re.findall(r"<script[^>]*>[^<]*</script>", page)
    assert scripts == ['<script src="inbox.js" defer></script>']
    assert "://" not in page and " style=" not in page and "onclick" not in page.lower()
    script = STATIC.joinpath("inbox.js").read_text("utf-8")
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "localStorage" not in script and "document.cookie" not in script
    assert "eval(" not in script and "new Function" not in script

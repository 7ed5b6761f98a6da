"""The human inbox (REACH §15) on the server side: ``agents.<name>.human`` in config
and in ``/peers``, and the static page under ``/inbox/`` with its headers.

The page itself runs in a real browser in tests/processes/browser_inbox.py.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources

import pytest
import pytest_twisted
import yaml

from relay.broker.inbox import CONTENT_SECURITY_POLICY
from relay.broker.operations import Policy
from relay.rules.config import ConfigError, parse_config
from relay.testing import SECRET, make_config
from tests.processes.test_security import get, raw_request
from tests.support.api import Broker, assert_error
from tests.support.processes import BrokerProcess

ALICE = "alice-secret-0123456789"
HUMAN = "human-secret-0123456789"
STATIC = resources.files("relay.broker.inbox").joinpath("static")


def human_broker() -> Broker:
    broker = Broker(config=make_config(agents={
        "alpha": {"secret": ALICE}, "dana": {"secret": HUMAN, "human": True}}))
    broker.secrets.update(alpha=ALICE, dana=HUMAN)
    return broker


# -- config -----------------------------------------------------------------------------


def test_human_is_read_from_the_agent_entry():
    config = make_config(agents={"alpha": {"secret": ALICE},
                                 "dana": {"secret": HUMAN, "human": True},
                                 "erin": {"secret": "erin-secret-0123456789", "human": False}})
    assert [name for name, agent in config.agents.items() if agent.human] == ["dana"]


@pytest.mark.parametrize("entry, key, reason", [
    ({"secret": HUMAN, "human": "yes"}, "agents.dana.human", "must be true or false"),
    ({"secret": HUMAN, "human": 1}, "agents.dana.human", "must be true or false"),
    ({"human": True}, "agents.dana.secret", "its own secret"),
])
def test_a_bad_human_entry_stops_the_start_with_its_key(entry, key, reason):
    with pytest.raises(ConfigError) as caught:
        parse_config({"broker": {"secret": SECRET, "storage": "memory"},
                      "agents": {"dana": entry}}, "/tmp")
    assert caught.value.key == key and reason in str(caught.value)


def test_a_human_may_sign_with_a_keyring_instead_of_a_secret():
    config = make_config(agents={"alpha": {"secret": ALICE},
                                 "dana": {"human": True, "keys": {"k1": {"secret": HUMAN}}}})
    assert config.agents["dana"].human and config.agents["dana"].keys


def test_a_human_with_the_shared_secret_only_is_refused():
    """A person signs in with a secret of their own: the shared ``broker.secret``
    (which every agent holds) would let any agent read and answer as them."""
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_load(f"""
broker: {{secret: {SECRET}, storage: memory}}
agents: {{dana: {{human: true}}}}
"""), "/tmp")
    assert caught.value.key == "agents.dana.secret"


# -- the wire ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_peers_marks_humans_and_only_them():
    broker = human_broker()
    await broker.register("alpha", "dana")
    reply = await broker.get("alpha", "/peers")
    assert reply.code == 200
    entries = {entry["agent"]: entry for entry in reply.json["peers"]}
    assert entries["dana"]["human"] is True
    assert "human" not in entries["alpha"]


@pytest_twisted.ensureDeferred
async def test_capabilities_name_the_inbox():
    reply = await human_broker().get(None, "/")
    assert reply.json["capabilities"]["humans"] == {"inbox": "/inbox/"}


# -- the page ---------------------------------------------------------------------------

PAGE_FILES = [("/inbox/", "index.html", "text/html; charset=utf-8"),
              ("/inbox/inbox.js", "inbox.js", "text/javascript; charset=utf-8"),
              ("/inbox/inbox.css", "inbox.css", "text/css; charset=utf-8"),
              ("/inbox/icon.svg", "icon.svg", "image/svg+xml")]


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


# -- the Host rule, over a real listener -------------------------------------------------


@pytest.mark.process
def test_the_page_obeys_the_host_rule(tmp_path):
    broker = BrokerProcess(str(tmp_path)).start()
    try:
        port = broker.port
        answer = raw_request(port, (f"GET /inbox/ HTTP/1.1\r\nHost: localhost:{port}\r\n"
                                    "Connection: close\r\n\r\n").encode("latin-1"))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert body == STATIC.joinpath("index.html").read_bytes()
        assert b"\r\ncontent-length: %d\r\n" % len(body) in head.lower()
        for path in ("/inbox/", "/inbox/inbox.js", "/inbox"):
            code, body = get(port, path, f"attacker.example:{port}")
            assert code == 403 and body["error"]["code"] == "forbidden", path
    finally:
        broker.stop()


@pytest_twisted.ensureDeferred
async def test_a_reload_makes_and_unmakes_people():
    broker = human_broker()
    await broker.register("alpha", "dana")
    broker.broker.configure(Policy.from_config(make_config(agents={
        "alpha": {"secret": ALICE, "human": True}, "dana": {"secret": HUMAN}})))
    reply = await broker.get("alpha", "/peers")
    assert [(p["agent"], p.get("human")) for p in reply.json["peers"]] == [
        ("alpha", True), ("dana", None)]

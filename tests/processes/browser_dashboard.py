"""The dashboard in a real browser (CI runs this file by name: ``pytest
tests/processes/browser_dashboard.py``; it needs the ``ci`` extra and Debian's chromium).

Headless Chromium, driven by Playwright with ``executable_path`` (Playwright
downloads no browser), loads the ops listener's page of a real broker with an
ops token (sent as HTTP Basic, as a person's browser would after its prompt):
it shows two agents after they register, its counts change after messages
flow, a dead letter appears and is requeued from the page, and a locked agent is
unlocked from it.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.processes.test_ops import TOKEN, OpsBroker

pytestmark = [pytest.mark.process, pytest.mark.browser]

CHROMIUM = os.environ.get("RELAY_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags a closed network refuses Chromium's own
# connections and it stalls; --no-sandbox because CI runs as root.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 15_000


@pytest.fixture
def broker(tmp_path):
    b = OpsBroker(str(tmp_path), maxAttempts=0).start()
    yield b
    b.stop()


@pytest.fixture
def page(tmp_path):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
            http_credentials={"username": "ops", "password": TOKEN},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def v2_pull(broker, agent: str):
    """``POST /v1/pull`` on the v2 wire (WIRE-V2), signed as the reference's clients sign."""
    import json
    import time
    import urllib.request

    from relay.wire.v2.canonical import canonical_body
    from relay.wire.v2.signing import signed_headers

    raw = canonical_body({"agent": agent})
    headers = signed_headers(broker.secret, agent, "POST", "/v1/pull", raw,
                             timestamp=int(time.time()))
    headers["Content-Type"] = "application/json"
    request = urllib.request.Request(broker.url + "/v1/pull", data=raw, headers=headers,
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def row(page, table: str, text: str):
    return page.locator(f"#{table} tbody tr", has_text=text)


def test_the_dashboard_follows_the_broker(broker, page, tmp_path):
    page.goto(f"http://127.0.0.1:{broker.ops_port}/")
    expect(page.locator("#health")).to_have_text("healthy", timeout=WAIT_MS)
    expect(page.locator("#agents tbody")).to_contain_text("no agents yet")

    for agent in ("beta", "gamma"):
        assert broker.request(agent, "POST", "/register", {})[0] == 200
    expect(page.locator("#agents tbody tr")).to_have_count(2, timeout=WAIT_MS)
    expect(row(page, "agents", "beta")).to_contain_text("online")
    expect(page.locator("#t-online-label")).to_have_text("agents online")
    # The chart is drawn in its own pixels: five rate labels and four time labels.
    expect(page.locator("#throughput text.tick")).to_have_count(9)
    expect(page.locator("#offline")).to_be_hidden()

    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError):  # unsigned: an authentication failure
        urllib.request.urlopen(f"{broker.url}/peers", timeout=10)
    expect(page.locator("#t-authfailures")).to_have_text("1", timeout=WAIT_MS)
    expect(page.locator("#t-authfailures").locator("..")).to_have_class("tile alert")
    expect(page.locator("#t-ratelimited")).to_have_text("0")

    for i in range(3):
        assert broker.request("alpha", "POST", "/messages", {"to": "beta", "id": f"b{i}"})[0] == 201
    expect(page.locator("#t-sent")).to_have_text("3", timeout=WAIT_MS)
    expect(page.locator("#t-queued")).to_have_text("3")
    expect(page.locator("#t-seedwire")).to_have_text(re.compile(r"^[1-9][0-9]*$"))
    expect(page.locator("#t-v2wire")).to_have_text("0")
    assert v2_pull(broker, "gamma") == {"messages": []}
    expect(page.locator("#t-v2wire")).to_have_text("1", timeout=WAIT_MS)
    expect(row(page, "pairs", "alpha")).to_contain_text("3")

    code, pulled = broker.request("beta", "POST", "/v1/pull", {"limit": 1})
    (lease,) = pulled["messages"]
    expect(row(page, "leases", lease["id"])).to_have_count(1, timeout=WAIT_MS)
    assert broker.request("beta", "POST", "/v1/ack", {
        "messageId": lease["id"], "leaseId": lease["leaseId"], "outcome": "retry",
        "error": "handler crashed"})[0] == 200
    dead = row(page, "dead", lease["id"])
    expect(dead).to_contain_text("handler crashed", timeout=WAIT_MS)
    expect(page.locator("#t-failed")).to_have_text("1")
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

    dead.get_by_role("button", name="requeue").click()
    expect(page.locator("#action")).to_have_text(f"requeued {lease['id']}", timeout=WAIT_MS)
    expect(page.locator("#dead tbody")).to_contain_text("no dead letters", timeout=WAIT_MS)
    expect(page.locator("#t-queued")).to_have_text("3")
    code, status = broker.request("alpha", "POST", "/v1/status", {"messageIds": [lease["id"]]})
    assert status["messages"][0]["status"] == "queued"


def test_an_operator_unlocks_an_agent_from_the_dashboard(broker, page):
    page.goto(f"http://127.0.0.1:{broker.ops_port}/")
    expect(page.locator("#locks tbody")).to_contain_text("no agent is locked", timeout=WAIT_MS)
    assert broker.request("alpha", "POST", "/register", {})[0] == 200
    good, broker.secret = broker.secret, "wrong-secret-0123456789"
    try:
        for _ in range(5):
            assert broker.request("alpha", "GET", "/peers")[0] == 401
    finally:
        broker.secret = good
    status, body = broker.request("alpha", "GET", "/peers")
    assert status == 403 and "the dashboard" in body["error"]["message"]
    lock = row(page, "locks", "alpha")
    expect(lock).to_contain_text("127.0.0.1", timeout=WAIT_MS)
    lock.get_by_role("button", name="unlock").click()
    expect(page.locator("#unlock-action")).to_have_text("unlocked alpha", timeout=WAIT_MS)
    expect(page.locator("#locks tbody")).to_contain_text("no agent is locked", timeout=WAIT_MS)
    assert broker.request("alpha", "GET", "/peers")[0] == 200

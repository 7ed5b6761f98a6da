"""The human inbox page (REACH §15) in a real browser (CI runs this file by name,
with tests/processes/browser_dashboard.py: ``make test-ops``; it needs the ``ci`` extra and
Debian's chromium).

Headless Chromium, driven by Playwright with ``executable_path``, opens
``/inbox/`` on the main listener of a real broker where ``dana`` is a person
(``human: true``). She signs in with her secret; a question an agent asks with
:class:`relay.client.client.RelayClient` appears live (from the event stream, with no
reload) and her click on an option is the answer the agent's ``await_reply``
gets. Bodies holding HTML and script are shown as text. Every request the page
made is inspected: the secret is in none, and in no storage but the tab's
``sessionStorage``. A model's ``relay_ask_human`` (``relay mcp``) is answered with
a click in the page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any, Dict, Iterator, List

import pytest
import yaml
from playwright.sync_api import expect, sync_playwright

from tests.support import REPO
from tests.support.processes import BrokerProcess

pytestmark = [pytest.mark.process, pytest.mark.browser]

CHROMIUM = os.environ.get("RELAY_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 15_000
ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789ab"
DANA = "dana-secret-Kq83vZ0p1x"
HOSTILE_TEXT = ('<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
                '<b id="injected">bold</b>')

# An agent asking dana with RelayClient in a process of its own: it prints the
# request's id, then the body of the answer its await_reply fires with.
ASKER = textwrap.dedent("""
    import json, sys, uuid
    from twisted.internet.task import react
    from relay.client.client import RelayClient, question_body

    async def main(reactor):
        url, agent, secret, to, question, *options = sys.argv[1:]
        client = RelayClient(url, agent, secret, clock=reactor, reactor=reactor)
        request_id = str(uuid.uuid4())
        await client.register()
        await client.send(to, question_body(question, options or None),
                          message_id=request_id, kind="request")
        print(json.dumps({"sent": request_id}), flush=True)
        reply = await client.await_reply(request_id, timeout=60, to=to)
        print(json.dumps({"from": reply["from"], "body": reply["body"]}), flush=True)

    react(lambda reactor: __import__("twisted.internet.defer", fromlist=["x"])
          .ensureDeferred(main(reactor)))
""")


@pytest.fixture
def broker(tmp_path) -> Iterator[BrokerProcess]:
    b = BrokerProcess(str(tmp_path), agents={
        "alice": {"secret": ALICE}, "bob": {"secret": BOB},
        "dana": {"secret": DANA, "human": True}})
    with open(b.config_path) as f:
        config = yaml.safe_load(f)
    config["groups"] = {"team": {"members": ["alice", "bob", "dana"]}}
    with open(b.config_path, "w") as f:
        yaml.safe_dump(config, f)
    b.start()
    for agent in ("alice", "bob"):
        assert b.request(agent, "POST", "/register", {})[0] == 200
    yield b
    b.stop()


@pytest.fixture
def browser(tmp_path):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield context
        finally:
            context.close()


class Watched:
    """A page with every request it makes and every console message it logs."""

    def __init__(self, context) -> None:
        self.context = context
        self.page = context.new_page()
        self.requests: List[Any] = []
        self.console: List[str] = []
        self.dialogs: List[str] = []
        self.page.on("request", lambda request: self.requests.append(request))
        self.page.on("console", lambda message: self.console.append(message.text))
        self.page.on("dialog", lambda dialog: (self.dialogs.append(dialog.message),
                                               dialog.dismiss()))

    def sign_in(self, broker: BrokerProcess, agent: str, secret: str) -> None:
        page = self.page
        page.goto(f"{broker.url}/inbox/")
        page.get_by_label("Agent name").fill(agent)
        page.get_by_label("Secret").fill(secret)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator("#who")).to_have_text(agent, timeout=WAIT_MS)
        expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)


def ask(broker: BrokerProcess, question: str, *options: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", ASKER, broker.url, "alice", ALICE, "dana", question, *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=str(REPO))
    line = process.stdout.readline()
    assert line, process.stderr.read()
    return process


def answer_of(process: subprocess.Popen) -> Dict[str, Any]:
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def item(page, text: str):
    return page.locator("#messages > li", has_text=text)


def test_a_person_answers_a_question_live_with_an_option(broker, browser, tmp_path):
    watched = Watched(browser)
    page = watched.page
    watched.sign_in(broker, "dana", DANA)
    expect(page.locator("#empty")).to_have_text("Nothing addressed to you yet.")

    asker = ask(broker, "Ship release 2.1 today?", "ship it", "wait a day")
    question = item(page, "Ship release 2.1 today?")
    expect(question).to_have_count(1, timeout=WAIT_MS)  # live: nothing reloaded it
    expect(question.locator(".state")).to_have_text("waiting for you")
    expect(question.locator(".party")).to_have_text("from alice")
    expect(question.get_by_role("button", name="wait a day")).to_be_visible()
    page.screenshot(path=str(tmp_path / "inbox-question.png"), full_page=True)
    question.get_by_role("button", name="ship it").click()

    assert answer_of(asker) == {"from": "dana", "body": {"answer": "ship it"}}
    expect(question.locator(".state")).to_have_text("answered", timeout=WAIT_MS)
    expect(question.get_by_role("button", name="ship it")).to_have_count(0)

    # A typed answer instead of an option, to a question with none; what the
    # person is typing stays as it is while another message arrives live.
    asker = ask(broker, "Which branch do we cut from?")
    open_question = item(page, "Which branch do we cut from?")
    expect(open_question).to_have_count(1, timeout=WAIT_MS)
    typed = open_question.get_by_label("Your answer")
    typed.type("release/2.1")
    assert broker.request("bob", "POST", "/messages", {
        "to": "dana", "body": {"text": "FYI: CI is green."}})[0] == 201
    expect(item(page, "FYI: CI is green.")).to_have_count(1, timeout=WAIT_MS)
    expect(typed).to_be_focused()
    typed.type(", not main")
    expect(typed).to_have_value("release/2.1, not main")
    open_question.get_by_role("button", name="Send answer").click()
    assert answer_of(asker)["body"] == {"answer": "release/2.1, not main"}
    # The newest first.
    expect(page.locator("#messages > li").first).to_contain_text("FYI: CI is green.")

    # The thread of the first question shows it and the answer.
    question.locator("summary", has_text="Thread").click()
    expect(question.locator(".thread-list > li")).to_have_count(2, timeout=WAIT_MS)
    expect(question.locator(".thread-list")).to_contain_text("Answer: ship it")
    assert not [line for line in watched.console if "Content Security Policy" in line]


def test_reject_with_a_reason_and_write_to_a_peer(broker, browser):
    watched = Watched(browser)
    page = watched.page
    watched.sign_in(broker, "dana", DANA)

    code, sent = broker.request("alice", "POST", "/messages", {
        "to": "dana", "kind": "request", "body": {"text": "Please drop the orders table."}})
    assert code == 201
    request = item(page, "Please drop the orders table.")
    expect(request).to_have_count(1, timeout=WAIT_MS)
    request.locator("summary", has_text="Reject").click()
    request.get_by_label("Reason (optional)").fill("not without a backup")
    request.get_by_role("button", name="Reject request").click()
    expect(request.locator(".state")).to_have_text("closed", timeout=WAIT_MS)
    code, status = broker.request("alice", "POST", "/v1/status", {"messageIds": [sent["id"]]})
    (entry,) = status["messages"]
    assert (entry["status"], entry["error"]) == ("failed", "not without a backup")

    # A new message to a peer chosen from /peers; people are marked as such.
    expect(page.locator("#to option[value='bob']")).to_have_count(1, timeout=WAIT_MS)
    assert page.locator("#to option[value='dana']").count() == 0  # not to herself
    page.get_by_text("Write a message").click()
    page.get_by_label("To").select_option("bob")
    page.get_by_label("Text").fill("The backup runs at six.")
    page.get_by_role("button", name="Send", exact=True).click()
    expect(page.locator("#compose-status")).to_have_text("Sent to bob.", timeout=WAIT_MS)
    code, pulled = broker.request("bob", "POST", "/v1/pull", {})
    (message,) = pulled["messages"]
    assert (message["from"], message["kind"], message["body"]) == (
        "dana", "message", {"text": "The backup runs at six."})
    page.get_by_role("button", name="Sent").click()
    expect(item(page, "The backup runs at six.")).to_have_count(1, timeout=WAIT_MS)

    # ...and to a group /peers lists: one copy for each member but her.
    expect(page.locator("#to option[value='group:team']")).to_have_text(
        "group:team (alice, bob, dana)")
    page.get_by_label("To").select_option("group:team")
    page.get_by_label("Text").fill("Standup moves to ten.")
    page.get_by_role("button", name="Send", exact=True).click()
    expect(page.locator("#compose-status")).to_have_text("Sent to group:team.",
                                                         timeout=WAIT_MS)
    for member in ("alice", "bob"):
        code, pulled = broker.request(member, "POST", "/v1/pull", {})
        (copy,) = [m for m in pulled["messages"] if m["from"] == "dana" and "via" in m]
        assert (copy["from"], copy["via"], copy["body"]) == (
            "dana", "group:team", {"text": "Standup moves to ten."})
    page.get_by_role("button", name="Received").click()
    assert broker.request("alice", "POST", "/messages", {
        "to": "group:team", "body": {"text": "Room 4 for the standup."}})[0] == 201
    expect(item(page, "Room 4 for the standup.").locator(".meta")).to_contain_text(
        "via group:team", timeout=WAIT_MS)

    # Signing out gives back what the page held: it waits in the queue again.
    code, waiting = broker.request("alice", "POST", "/messages", {
        "to": "dana", "kind": "request", "body": {"question": "Later?"}})
    expect(item(page, "Later?").locator(".state")).to_have_text("waiting for you",
                                                               timeout=WAIT_MS)
    assert broker.request("alice", "POST", "/v1/status", {"messageIds": [waiting["id"]]})[1][
        "messages"][0]["status"] == "leased"
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("Secret")).to_be_visible(timeout=WAIT_MS)
    assert broker.request("alice", "POST", "/v1/status", {"messageIds": [waiting["id"]]})[1][
        "messages"][0]["status"] == "queued"

    # A wrong secret is refused with a clear message.
    page.get_by_label("Agent name").fill("dana")
    page.get_by_label("Secret").fill("not-the-secret-at-all")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#sign-in-error")).to_contain_text("did not accept", timeout=WAIT_MS)
    assert page.evaluate("sessionStorage.length") == 0


def test_what_others_wrote_is_shown_as_text(broker, browser):
    watched = Watched(browser)
    page = watched.page
    watched.sign_in(broker, "dana", DANA)
    assert broker.request("bob", "POST", "/messages", {
        "to": "dana", "body": {"text": HOSTILE_TEXT}})[0] == 201
    assert broker.request("alice", "POST", "/messages", {
        "to": "dana", "kind": "request",
        "body": {"question": HOSTILE_TEXT, "options": ["<i id='opt'>yes</i>", "no"]}})[0] == 201
    shown = page.locator("#messages pre.body", has_text="window.__pwned=2")
    expect(shown).to_have_count(1, timeout=WAIT_MS)
    expect(shown).to_have_text(HOSTILE_TEXT)
    expect(page.locator("#messages .question")).to_have_text(HOSTILE_TEXT, timeout=WAIT_MS)
    expect(page.get_by_role("button", name="<i id='opt'>yes</i>")).to_be_visible()
    page.wait_for_timeout(500)  # time for an injected image's error handler to run
    assert page.evaluate("window.__pwned") is None
    injected = "#messages img, #messages script, #messages b, #messages i, #injected, #opt"
    assert page.locator(injected).count() == 0
    assert watched.dialogs == []


def test_the_secret_stays_in_the_tab(broker, browser):
    watched = Watched(browser)
    page = watched.page
    watched.sign_in(broker, "dana", DANA)
    asker = ask(broker, "Merge the fix?", "merge", "hold")
    question = item(page, "Merge the fix?")
    expect(question).to_have_count(1, timeout=WAIT_MS)
    question.get_by_role("button", name="merge").click()
    assert answer_of(asker)["body"] == {"answer": "merge"}
    page.get_by_text("Write a message").click()
    page.get_by_label("To").select_option("alice")
    page.get_by_label("Text").fill("done")
    page.get_by_role("button", name="Send", exact=True).click()
    expect(page.locator("#compose-status")).to_have_text("Sent to alice.", timeout=WAIT_MS)
    page.reload()  # the tab keeps the person signed in
    expect(page.locator("#who")).to_have_text("dana", timeout=WAIT_MS)
    expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)

    signed = [r for r in watched.requests if "x-relay-signature" in r.headers]
    assert {r.url.split("?")[0].replace(broker.url, "") for r in signed} >= {
        "/register", "/peers", "/v1/pull", "/v1/ack", "/v1/messages/query", "/messages",
        "/v1/events"}
    assert all(r.headers["x-relay-agent"] == "dana" and "x-relay-nonce" in r.headers
               for r in signed)
    for request in watched.requests:
        seen = [request.url, json.dumps(request.all_headers())]
        body = request.post_data_buffer
        if body:
            seen.append(body.decode("utf-8", "replace"))
        assert not any(DANA in text for text in seen), request.url

    assert page.evaluate("sessionStorage.getItem('relay.inbox.secret')") == DANA
    assert page.evaluate("localStorage.length") == 0
    assert page.evaluate("document.cookie") == ""
    assert browser.cookies() == []
    assert page.evaluate("indexedDB.databases().then(list => list.length)") == 0
    assert page.evaluate("caches.keys().then(list => list.length)") == 0

    # Another tab of the same browser has nothing of it.
    other = browser.new_page()
    other.goto(f"{broker.url}/inbox/")
    expect(other.get_by_label("Secret")).to_be_visible()
    assert other.evaluate("sessionStorage.length") == 0

    page.get_by_role("button", name="Sign out").click()
    assert page.evaluate("sessionStorage.length") == 0


def test_the_page_fits_a_phone(broker, browser, tmp_path):
    watched = Watched(browser)
    page = watched.page
    page.set_viewport_size({"width": 360, "height": 740})
    watched.sign_in(broker, "dana", DANA)
    asker = ask(broker, "Approve the deploy to production after the checks pass?",
                "approve", "reject", "ask me again tomorrow")
    question = item(page, "Approve the deploy")
    expect(question).to_have_count(1, timeout=WAIT_MS)
    page.screenshot(path=str(tmp_path / "inbox-phone.png"), full_page=True)
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
    box = question.get_by_role("button", name="ask me again tomorrow").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 360 and box["height"] >= 36
    question.get_by_role("button", name="approve").click()
    assert answer_of(asker)["body"] == {"answer": "approve"}


def test_a_model_asks_through_mcp_and_the_person_answers_in_the_page(broker, browser,
                                                                     tmp_path):
    """``relay_ask_human`` of ``relay mcp`` (the SDK's own client), answered with a
    click in the page."""
    import asyncio
    import threading
    from contextlib import AsyncExitStack

    from relay.mcp import unavailable
    from tests.processes.test_mcp import open_session

    problem = unavailable()
    if problem is not None:
        pytest.skip(problem)
    secret = tmp_path / "alice.secret"
    secret.write_text(ALICE + "\n")
    secret.chmod(0o600)
    broker.secret_file = str(secret)  # what open_session passes to relay mcp

    watched = Watched(browser)
    page = watched.page
    watched.sign_in(broker, "dana", DANA)
    results: List[Any] = []

    async def model() -> None:
        async with AsyncExitStack() as stack:
            alice = await open_session(stack, broker, "alice")
            results.append(await alice.call(
                "relay_ask_human", to="dana", question="Rotate the staging keys now?",
                options=["rotate now", "after the demo"], wait_seconds=20))

    thread = threading.Thread(target=lambda: asyncio.run(model()))
    thread.start()
    question = item(page, "Rotate the staging keys now?")
    expect(question).to_have_count(1, timeout=30_000)
    question.get_by_role("button", name="after the demo").click()
    thread.join(60)
    assert not thread.is_alive()
    (asked,) = results
    assert asked["answered"] is True
    assert asked["untrusted"] == {"from": "dana", "body": {"answer": "after the demo"}}

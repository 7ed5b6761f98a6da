// The relay's inbox for a person (REACH §15). No build step, no dependency.
//
// The person's secret stays in this tab (sessionStorage) and is never sent: every
// request is signed here with WebCrypto HMAC-SHA256 as the wire's §3 says (with a
// signed nonce, EXTENSIONS §9). Everything another party wrote is put in the page
// as text (textContent), never as HTML.
"use strict";

(() => {
  const STORE_AGENT = "relay.inbox.agent";
  const STORE_SECRET = "relay.inbox.secret";
  const AGENT_NAME = /^[A-Za-z0-9_.-]{1,64}$/;
  const LEASE_SECONDS = 900;          // a request the page holds for its person
  const RENEW_BELOW_MS = 600 * 1000;  // renewed when less than this is left
  const TICK_MS = 60 * 1000;          // heartbeat, lease renewal, peers
  const POLL_MS = 15 * 1000;          // without an event stream
  const LIST_LIMIT = 200;
  const encoder = new TextEncoder();

  const $ = (id) => document.getElementById(id);

  let session = null;      // {agent, key, skew}
  let view = "inbox";      // or "sent"
  let leases = new Map();  // message id -> {leaseId, until (ms)}
  let lastEventId = null;
  let stream = null;       // AbortController of the event stream
  let timers = [];
  let refreshing = null;
  let refreshAgain = false;
  // message id -> {node, key}: an item is rebuilt only when its state changes, so
  // what the person is typing or has opened stays as it is while others arrive
  let shown = new Map();
  let serial = 0;

  // -- building the page (text only) -------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else if (key === "on") for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
      else if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function showError(text) {
    const box = $("error");
    box.textContent = text || "";
    box.hidden = !text;
  }

  function setLive(text, ok) {
    const live = $("live");
    live.textContent = text;
    live.classList.toggle("on", !!ok);
  }

  // -- signing (spec §3, EXTENSIONS §9) ----------------------------------------------

  function hex(buffer) {
    return Array.from(new Uint8Array(buffer), (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function newNonce() {
    const bytes = crypto.getRandomValues(new Uint8Array(24));
    return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function importKey(secret) {
    return crypto.subtle.importKey("raw", encoder.encode(secret), { name: "HMAC", hash: "SHA-256" },
      false, ["sign"]);
  }

  class RelayError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function signedFetch(method, path, body, options, as) {
    const signer = as || session;
    if (!signer) throw new RelayError(0, "signed_out", "signed out");
    const raw = body === undefined ? "" : JSON.stringify(body);
    const timestamp = String(Math.floor(Date.now() / 1000) + signer.skew);
    const nonce = newNonce();
    const signed = [method, path, timestamp, raw, signer.agent, nonce].join("\n");
    const signature = hex(await crypto.subtle.sign("HMAC", signer.key, encoder.encode(signed)));
    const headers = {
      "X-Relay-Agent": signer.agent,
      "X-Relay-Timestamp": timestamp,
      "X-Relay-Signature": signature,
      "X-Relay-Nonce": nonce,
    };
    if (raw) headers["Content-Type"] = "application/json";
    return fetch(path, {
      method, headers, body: raw || undefined, cache: "no-store", credentials: "omit",
      redirect: "error", referrerPolicy: "no-referrer", signal: options && options.signal,
    });
  }

  async function failure(response) {
    let code = "http_" + response.status;
    let message = response.statusText || "request failed";
    try {
      const document = await response.json();
      if (document && document.error) {
        code = String(document.error.code);
        message = String(document.error.message);
      }
    } catch (_) { /* not JSON */ }
    return new RelayError(response.status, code, message);
  }

  // ``as``: the session to sign with (the current one by default).
  async function api(method, path, body, as) {
    let response;
    try {
      response = await signedFetch(method, path, body, undefined, as);
    } catch (e) {
      if (e instanceof RelayError) throw e;
      throw new RelayError(0, "unreachable", "the broker cannot be reached");
    }
    if (!response.ok) throw await failure(response);
    return response.json();
  }

  function explain(error) {
    if (!(error instanceof RelayError)) return "Something went wrong: " + String(error && error.message);
    switch (error.code) {
      case "unauthenticated":
        return "The broker did not accept this name and secret (" + error.message +
          "). Check both, and that this device's clock is right.";
      case "unknown_agent":
        return "The broker has no agent of this name.";
      case "locked":
        return "Locked: " + error.message;
      case "rate_limited":
        return "Too many requests from here: wait a minute and try again.";
      case "unreachable":
        return "The broker cannot be reached. Is it running?";
      default:
        return error.message + " (" + error.status + " " + error.code + ")";
    }
  }

  // The broker's GET / (unsigned): its capabilities, and how far this device's clock
  // is from the broker's (whose clock decides whether a signed timestamp is fresh: a
  // phone's or a laptop woken from sleep may be off).
  async function brokerInfo() {
    try {
      const response = await fetch("/", { cache: "no-store", credentials: "omit" });
      const date = Date.parse(response.headers.get("date") || "");
      const document = await response.json();
      return { skew: Number.isNaN(date) ? 0 : Math.round((date - Date.now()) / 1000),
        capabilities: (document && document.capabilities) || {} };
    } catch (_) {
      return { skew: 0, capabilities: {} };  // the register below says what is wrong
    }
  }

  // -- signing in and out --------------------------------------------------------------

  async function signIn(agent, secret) {
    if (!AGENT_NAME.test(agent)) throw new Error("An agent name is 1 to 64 of A-Z a-z 0-9 _ . -");
    if (!secret) throw new Error("Type the secret of this agent.");
    if (!window.isSecureContext || !crypto.subtle) {
      throw new Error("This page can sign only over https:// or on this machine " +
        "(http://127.0.0.1 or http://localhost): the browser offers WebCrypto nowhere else.");
    }
    const info = await brokerInfo();
    session = { agent, key: await importKey(secret), skew: info.skew };
    try {
      await api("POST", "/register", { agent });
    } catch (e) {
      session = null;
      throw e;
    }
    sessionStorage.setItem(STORE_AGENT, agent);
    sessionStorage.setItem(STORE_SECRET, secret);
    $("who").textContent = agent;
    $("sign-in").hidden = true;
    $("account").hidden = false;
    $("app").hidden = false;
    timers.push(setInterval(tick, TICK_MS));
    loadPeers().catch((e) => showError(explain(e)));
    await refresh();
    if (info.capabilities.events) openEvents();
    else {
      setLive("updates every 15 s", true);
      timers.push(setInterval(scheduleRefresh, POLL_MS));
    }
  }

  async function signOut() {
    const ending = session;
    if (!ending) return;
    // Nothing runs for this session any more: no stream, no timer, no refresh.
    if (stream) stream.abort();
    stream = null;
    timers.forEach(clearInterval);
    timers = [];
    session = null;
    sessionStorage.removeItem(STORE_AGENT);
    sessionStorage.removeItem(STORE_SECRET);
    $("sign-out").disabled = true;
    // Give back what this page holds (once a pull under way has ended), so it
    // waits in the queue again at once rather than when its lease lapses.
    if (refreshing) await refreshing;
    const held = Array.from(leases.entries());
    await Promise.all(held.map(([id, lease]) => api("POST", "/v1/ack",
      { messageId: id, leaseId: lease.leaseId, outcome: "release" }, ending).catch(() => null)));
    leases = new Map();
    shown = new Map();
    lastEventId = null;
    $("messages").replaceChildren();
    $("to").replaceChildren();
    showError("");
    $("sign-out").disabled = false;
    $("app").hidden = true;
    $("account").hidden = true;
    $("sign-in").hidden = false;
    $("secret").value = "";
    $("agent").focus();
  }

  async function tick() {
    if (!session) return;
    try {
      await api("POST", "/register", { agent: session.agent });
      await renewLeases();
      await loadPeers();
    } catch (e) {
      if (session) showError(explain(e));
    }
  }

  // -- peers, groups and roles ----------------------------------------------------------

  async function loadPeers() {
    const peers = [];
    let groups = [];
    let roles = [];
    let after = null;
    for (let page = 0; page < 50; page++) {
      const path = "/peers?cards=false" + (after ? "&after=" + encodeURIComponent(after) : "");
      const document = await api("GET", path);
      peers.push(...(document.peers || []));
      if (Array.isArray(document.groups)) groups = document.groups;
      if (Array.isArray(document.roles)) roles = document.roles;
      if (!document.next) break;
      after = document.next;
    }
    const select = $("to");
    const chosen = select.value;
    const options = [];
    const people = el("optgroup", { label: "Agents and people" });
    for (const peer of peers) {
      if (peer.agent === session.agent) continue;
      const label = peer.agent + (peer.human ? " (person)" : "") + (peer.online ? "" : " (offline)");
      people.append(el("option", { value: peer.agent, text: label }));
    }
    options.push(people);
    for (const [title, list, prefix] of [["Groups", groups, "group:"], ["Roles", roles, "role:"]]) {
      if (!list.length) continue;
      const group = el("optgroup", { label: title });
      for (const entry of list) {
        if (!entry || typeof entry.name !== "string") continue;
        const members = Array.isArray(entry.members) ? " (" + entry.members.join(", ") + ")" : "";
        group.append(el("option", { value: prefix + entry.name, text: prefix + entry.name + members }));
      }
      options.push(group);
    }
    select.replaceChildren(...options);
    if (chosen) select.value = chosen;
  }

  // -- leases: the page holds the requests its person may answer ------------------------

  function remember(message) {
    if (message.leaseId) {
      leases.set(message.id, { leaseId: message.leaseId, message,
        until: message.leaseUntil || Date.now() + LEASE_SECONDS * 1000 });
    }
  }

  // Lease what waits for this person. A request stays leased while the page is open
  // (renewed); anything else is shown, so it is done.
  async function takeWaiting() {
    for (let round = 0; round < 10; round++) {
      const document = await api("POST", "/v1/pull",
        { agent: session.agent, limit: 100, leaseSeconds: LEASE_SECONDS });
      const messages = document.messages || [];
      for (const message of messages) {
        if (message.kind === "request") remember(message);
        else {
          await api("POST", "/v1/ack",
            { messageId: message.id, leaseId: message.leaseId, outcome: "completed" });
        }
      }
      if (messages.length < 100) return;
    }
  }

  async function renewLeases() {
    const now = Date.now();
    for (const [id, lease] of leases) {
      if (lease.until - now > RENEW_BELOW_MS) continue;
      try {
        const answer = await api("POST", "/v1/lease/renew",
          { messageId: id, leaseId: lease.leaseId, leaseSeconds: LEASE_SECONDS });
        lease.until = answer.leaseUntil || now + LEASE_SECONDS * 1000;
      } catch (e) {
        if (!(e instanceof RelayError) || ![403, 404, 409].includes(e.status)) continue;
        leases.delete(id);  // gone, or no longer this page's: the list says what became of it
        scheduleRefresh();
      }
    }
  }

  // -- the list -----------------------------------------------------------------------

  function scheduleRefresh() {
    if (refreshing) refreshAgain = true;
    else refresh();
  }

  async function refresh() {
    if (!session) return;
    refreshing = (async () => {
      do {
        refreshAgain = false;
        try {
          await load();
          showError("");
        } catch (e) {
          if (session) showError(explain(e));
        }
      } while (refreshAgain && session);
    })();
    await refreshing;
    refreshing = null;
  }

  async function load() {
    if (view === "inbox") await takeWaiting();
    // The newest first, as the broker orders them; in the inbox, every request the
    // page holds too, however old.
    const document = await api("POST", "/v1/messages/query",
      { agent: session.agent, box: view, limit: LIST_LIMIT });
    const messages = (document.messages || []).slice();
    if (view === "inbox") {
      const listed = new Set(messages.map((m) => m.id));
      const leased = await api("POST", "/v1/messages/query",
        { agent: session.agent, box: "inbox", status: "leased", kind: "request", limit: LIST_LIMIT });
      for (const message of leased.messages || []) {
        if (!listed.has(message.id)) {
          listed.add(message.id);
          messages.push(message);
        }
      }
      for (const message of messages) {
        if (message.leaseId) remember(message);
        else leases.delete(message.id);  // answered, or taken back: no longer this page's
      }
      // What the page holds but no query lists (a message to a role the person
      // holds is in no one's inbox) is shown as it was pulled.
      for (const [id, lease] of leases) if (!listed.has(id)) messages.push(lease.message);
    }
    draw(messages);
  }

  function draw(messages) {
    const list = $("messages");
    const next = new Map();
    let cursor = list.firstChild;
    for (const message of messages) {
      if (next.has(message.id)) continue;
      const key = [view, message.status, leases.has(message.id)].join("|");
      let entry = shown.get(message.id);
      if (!entry || entry.key !== key) {
        if (entry) {
          if (entry.node === cursor) cursor = cursor.nextSibling;
          entry.node.remove();
        }
        entry = { node: item(message), key };
      }
      next.set(message.id, entry);
      if (entry.node === cursor) cursor = cursor.nextSibling;
      else list.insertBefore(entry.node, cursor);
    }
    for (const [id, entry] of shown) if (!next.has(id)) entry.node.remove();
    shown = next;
    $("empty").hidden = messages.length > 0;
    $("empty").textContent = view === "inbox" ? "Nothing addressed to you yet." : "You have sent nothing yet.";
  }

  function question(body) {
    if (!body || typeof body !== "object" || typeof body.question !== "string") return null;
    const options = body.options;
    const valid = Array.isArray(options) && options.length >= 1 && options.length <= 10 &&
      options.every((o) => typeof o === "string");
    return { text: body.question, options: valid ? options : [] };
  }

  function bodyText(body) {
    if (body && typeof body === "object") {
      const keys = Object.keys(body);
      if (keys.length === 1 && typeof body.text === "string") return body.text;
      if (keys.length === 1 && typeof body.answer === "string") return "Answer: " + body.answer;
      if (keys.length === 0) return "(empty)";
    }
    return JSON.stringify(body, null, 2);
  }

  function when(ts) {
    const date = new Date(ts);
    if (Number.isNaN(date.getTime())) return String(ts);
    return date.toLocaleString();
  }

  function stateOf(message) {
    if (message.kind !== "request") return null;
    switch (message.status) {
      case "done": return ["answered", "done"];
      case "failed": return ["closed", "failed"];
      case "leased":
        return leases.has(message.id) ? ["waiting for you", "waiting"] : ["taken elsewhere", "elsewhere"];
      default: return view === "inbox" ? ["waiting for you", "waiting"] : ["waiting", "waiting"];
    }
  }

  function item(message) {
    const incoming = view === "inbox";
    const state = stateOf(message);
    const asked = question(message.body);
    const li = el("li", { class: "message" + (message.kind === "request" ? " request" : "") +
      (state ? " " + state[1] : "") });
    const idPart = "m" + (++serial);  // names the item's fields for their labels
    li.append(el("div", { class: "meta" },
      el("span", { class: "party", text: incoming ? "from " + message.from : "to " + message.to }),
      el("span", { class: "badge", text: message.kind }),
      typeof message.via === "string" ? el("span", { class: "badge", text: "via " + message.via }) : null,
      state ? el("span", { class: "state " + state[1], text: state[0] }) : null,
      el("time", { datetime: message.ts, text: when(message.ts) })));
    if (asked) {
      li.append(el("p", { class: "question", text: asked.text }));
      const rest = Object.assign({}, message.body);
      delete rest.question;
      delete rest.options;
      if (Object.keys(rest).length) li.append(el("pre", { class: "body", text: JSON.stringify(rest, null, 2) }));
    } else {
      li.append(el("pre", { class: "body", text: bodyText(message.body) }));
    }
    const lease = leases.get(message.id);
    if (incoming && message.kind === "request" && lease) li.append(answerForm(message, lease, asked, idPart));
    li.append(thread(message));
    return li;
  }

  function answerForm(message, lease, asked, idPart) {
    const form = el("form", { class: "answer", novalidate: true });
    const status = el("p", { class: "hint", role: "status", "aria-live": "polite" });
    const send = async (ack, doing) => {
      for (const button of form.querySelectorAll("button")) button.disabled = true;
      status.textContent = doing;
      try {
        await acknowledge(message.id, ack);
        status.textContent = "Sent.";
        scheduleRefresh();
      } catch (e) {
        status.textContent = explain(e);
        for (const button of form.querySelectorAll("button")) button.disabled = false;
      }
    };
    const answer = (text) => send({ outcome: "completed", reply: { body: { answer: text } } }, "Answering…");
    if (asked && asked.options.length) {
      const choices = el("div", { class: "options", role: "group", "aria-label": "Answer with an option" });
      for (const option of asked.options) {
        choices.append(el("button", { type: "button", class: "option", text: option,
          on: { click: () => answer(option) } }));
      }
      form.append(choices);
    }
    const typed = el("textarea", { id: "answer-" + idPart, rows: "2" });
    const reason = el("input", { id: "reason-" + idPart, type: "text", maxlength: "1000" });
    form.append(
      el("label", { for: "answer-" + idPart,
        text: asked && asked.options.length ? "Or write your answer" : "Your answer" }),
      typed,
      el("div", { class: "actions" },
        el("button", { type: "submit", text: "Send answer" }),
        el("details", { class: "reject" },
          el("summary", { text: "Reject…" }),
          el("label", { for: "reason-" + idPart, text: "Reason (optional)" }),
          reason,
          el("button", { type: "button", class: "danger", text: "Reject request",
            on: { click: () => send({ outcome: "reject", error: reason.value.trim() ||
              "rejected by " + session.agent }, "Rejecting…") } }))),
      status);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const text = typed.value.trim();
      if (!text) {
        status.textContent = "Write an answer first" + (asked && asked.options.length ? ", or choose an option." : ".");
        typed.focus();
        return;
      }
      answer(text);
    });
    return form;
  }

  async function acknowledge(id, fields) {
    const lease = leases.get(id);
    const body = Object.assign({ messageId: id, leaseId: lease.leaseId }, fields);
    try {
      await api("POST", "/v1/ack", body);
    } catch (e) {
      // The lease lapsed (a sleeping laptop): take the request again and answer once more.
      if (!(e instanceof RelayError) || e.code !== "not_leased" && e.code !== "lease_mismatch") throw e;
      leases.delete(id);
      await takeWaiting();
      const again = leases.get(id);
      if (!again) throw new RelayError(409, e.code, "this request is no longer waiting for you");
      await api("POST", "/v1/ack", Object.assign(body, { leaseId: again.leaseId }));
    }
    leases.delete(id);
  }

  function thread(message) {
    const root = message.rootId || message.id;
    const details = el("details", { class: "thread" });
    const list = el("ol", { class: "thread-list" });
    details.append(el("summary", { text: "Thread" }), list);
    details.addEventListener("toggle", async () => {
      if (!details.open) return;
      list.replaceChildren(el("li", { class: "hint", text: "Loading…" }));
      try {
        const document = await api("POST", "/v1/thread", { agent: session.agent, rootId: root, limit: 200 });
        const entries = (document.messages || []).map((m) => el("li", { class: m.id === message.id ? "current" : "" },
          el("div", { class: "meta" },
            el("span", { class: "party", text: m.from + " → " + m.to }),
            el("span", { class: "badge", text: m.kind }),
            el("time", { datetime: m.ts, text: when(m.ts) })),
          el("pre", { class: "body", text: bodyText(m.body) })));
        list.replaceChildren(...(entries.length ? entries : [el("li", { class: "hint", text: "No other message." })]));
      } catch (e) {
        list.replaceChildren(el("li", { class: "error", text: explain(e) }));
      }
    });
    return details;
  }

  // -- writing --------------------------------------------------------------------------

  async function compose(event) {
    event.preventDefault();
    const to = $("to").value;
    const text = $("text").value.trim();
    const status = $("compose-status");
    if (!to) {
      status.textContent = "Choose a recipient.";
      return;
    }
    if (!text) {
      status.textContent = "Write something first.";
      $("text").focus();
      return;
    }
    $("send").disabled = true;
    status.textContent = "Sending…";
    try {
      await api("POST", "/messages", { id: crypto.randomUUID(), to, type: "message",
        kind: $("kind").value, body: { text } });
      $("text").value = "";
      status.textContent = "Sent to " + to + ".";
      if (view === "sent") scheduleRefresh();
    } catch (e) {
      status.textContent = explain(e);
    } finally {
      $("send").disabled = false;
    }
  }

  // -- live updates: the event stream, read with fetch (REACH §11) -----------------------

  function openEvents() {
    const controller = new AbortController();
    stream = controller;
    (async () => {
      let backoff = 1000;
      while (session && stream === controller) {
        try {
          const path = "/v1/events" + (lastEventId ? "?since=" + encodeURIComponent(lastEventId) : "");
          const response = await signedFetch("GET", path, undefined, { signal: controller.signal });
          if (!response.ok) throw await failure(response);
          setLive("live", true);
          backoff = 1000;
          scheduleRefresh();  // whatever happened while the stream was closed
          await readEvents(response.body);
        } catch (e) {
          if (controller.signal.aborted) return;
          if (e instanceof RelayError && (e.status === 401 || e.status === 403)) {
            // Retrying a refused signature would only count failures toward a lock.
            setLive("stopped", false);
            showError(explain(e) + " Sign out and sign in again.");
            return;
          }
          if (e instanceof RelayError && e.status !== 503 && e.status !== 0) showError(explain(e));
        }
        if (!session || stream !== controller) return;
        setLive("reconnecting", false);
        await new Promise((resolve) => setTimeout(resolve, backoff));
        backoff = Math.min(backoff * 2, 30000);
      }
    })();
  }

  async function readEvents(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const record = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = { id: null, type: "message" };
        for (const line of record.split("\n")) {
          if (line.startsWith("id:")) event.id = line.slice(3).trim();
          else if (line.startsWith("event:")) event.type = line.slice(6).trim();
        }
        if (event.id === null) continue;  // a keepalive
        lastEventId = event.id;
        scheduleRefresh();
      }
    }
  }

  // -- wiring -----------------------------------------------------------------------------

  function setView(next) {
    view = next;
    $("show-inbox").setAttribute("aria-pressed", String(next === "inbox"));
    $("show-sent").setAttribute("aria-pressed", String(next === "sent"));
    $("inbox-title").textContent = next === "inbox" ? "Inbox" : "Sent";
    shown = new Map();
    $("messages").replaceChildren();
    scheduleRefresh();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const error = $("sign-in-error");
      const button = $("sign-in-button");
      error.textContent = "";
      button.disabled = true;
      try {
        await signIn($("agent").value.trim(), $("secret").value);
        $("secret").value = "";
      } catch (e) {
        error.textContent = e instanceof RelayError ? explain(e) : e.message;
      } finally {
        button.disabled = false;
      }
    });
    $("sign-out").addEventListener("click", signOut);
    $("compose").addEventListener("submit", compose);
    $("refresh").addEventListener("click", scheduleRefresh);
    $("show-inbox").addEventListener("click", () => setView("inbox"));
    $("show-sent").addEventListener("click", () => setView("sent"));
    const agent = sessionStorage.getItem(STORE_AGENT);
    const secret = sessionStorage.getItem(STORE_SECRET);
    if (agent && secret) {
      $("agent").value = agent;
      signIn(agent, secret).catch((e) => {
        if (e instanceof RelayError && (e.status === 401 || e.status === 403)) {
          sessionStorage.removeItem(STORE_SECRET);
        }
        $("sign-in-error").textContent = e instanceof RelayError ? explain(e) : e.message;
      });
    } else {
      $("agent").focus();
    }
  });
})();

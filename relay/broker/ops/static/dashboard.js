// The relay broker's dashboard: reads the ops JSON API every few seconds.
// No framework, no build step, nothing loaded from elsewhere. Every value from
// the broker is written with textContent, never as HTML.
"use strict";

const REFRESH_MS = 3000;
const SERIES = [
  ["sent", "sent", "var(--sent)"],
  ["delivered", "delivered", "var(--delivered)"],
  ["acked", "acked", "var(--acked)"],
  ["deadLettered", "dead-lettered", "var(--dead)"],
];
const SVG = "http://www.w3.org/2000/svg";

function $(id) { return document.getElementById(id); }

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function plural(count, one, many) {
  return count === 1 ? one : many;
}

function sum(counts) {
  return Object.values(counts || {}).reduce((a, b) => a + b, 0);
}

function pairs(counts) {
  return Object.entries(counts || {}).filter(([, n]) => n)
    .map(([k, n]) => `${k.replace(/_/g, " ")} ${n}`).join(", ");
}

// A short label that fits: the name itself, or its start and an ellipsis.
function shorten(name, chars) {
  return name.length <= chars ? name : name.slice(0, chars - 1) + "…";
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return s + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function fill(tbody, rows, columns, empty) {
  tbody.replaceChildren();
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", empty, "empty");
    td.colSpan = columns;
    tr.append(td);
    tbody.append(tr);
    return;
  }
  for (const cells of rows) {
    const tr = el("tr");
    for (const cell of cells) tr.append(cell);
    tbody.append(tr);
  }
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  const document = await response.json();
  if (!response.ok) throw new Error((document.error && document.error.message) || response.status);
  return document;
}

async function postJSON(path, body) {
  const response = await fetch(path, {
    method: "POST", credentials: "same-origin",
    headers: { "content-type": "application/json" }, body: JSON.stringify(body),
  });
  const document = await response.json();
  if (!response.ok) throw new Error((document.error && document.error.message) || response.status);
  return document;
}

function showBroker(overview) {
  const b = overview.broker;
  $("broker").textContent = `${b.version} · ${b.storage} · up ${age(b.uptimeSeconds)}`;
  const health = $("health");
  health.textContent = b.healthy ? "healthy" : "unhealthy: " + b.health;
  health.className = "badge " + (b.healthy ? "ok" : "bad");
  const t = overview.totals;
  $("t-online").textContent = t.agentsOnline;
  $("t-online-label").textContent = plural(t.agentsOnline, "agent online", "agents online");
  $("t-queued").textContent = t.queued;
  $("t-leased").textContent = t.leased;
  $("t-delayed").textContent = t.delayed;
  $("t-failed").textContent = t.failed;
  $("t-sent").textContent = t.sent;
  $("t-delivered").textContent = t.delivered;
  $("t-groupsends").textContent = sum(t.groupSends);
  $("t-groupsends").title = pairs(t.groupSends) || "";
  $("t-waiting").textContent = t.pullWaiting;
  const wires = t.requestsByWire || {};
  $("t-seedwire").textContent = wires.seed || 0;
  $("t-v2wire").textContent = wires.v2 || 0;
  const refused = [
    ["t-ratelimited", t.rateLimited || 0], ["t-sendsrefused", sum(t.sendsRefused)],
    ["t-authfailures", sum(t.authFailures)], ["t-lockouts", t.lockouts],
  ];
  for (const [id, count] of refused) {
    $(id).textContent = count;
    $(id).parentElement.classList.toggle("alert", count > 0);
  }
  const detail = [pairs(t.sendsRefused), pairs(t.authFailures)].filter(Boolean).join("; ");
  $("refusal-detail").textContent = detail ? "by reason: " + detail : "";
}

// An id cut to the column's width (a table cell's own max-width is ignored);
// the whole id on hover.
function idCell(id) {
  const cell = el("td", null, "id");
  const text = el("span", id, "cut");
  text.title = id;
  cell.append(text);
  return cell;
}

function cardCell(card) {
  const cell = el("td", null, "wrap opt");
  if (card) {
    if (card.description) cell.append(el("div", card.description));
    if (card.skills && card.skills.length) {
      cell.append(el("div", card.skills.join(", "), "card-skills"));
    }
  }
  return cell;
}

// A webhook's health (REACH §12): the overview never carries its URL.
function webhookCell(now, hook) {
  if (!hook) return el("td", "–", "opt");
  if (hook.disabled) return el("td", "disabled", "opt late");
  if (hook.failingSince !== null) return el("td", "failing " + age(now - hook.failingSince), "opt late");
  return el("td", hook.lastDelivered === null ? "ok" : "ok " + seen(now, hook.lastDelivered), "opt");
}

function seen(now, lastSeen) {
  return lastSeen === null ? "–" : age(now - lastSeen) + " ago";
}

// Online agents and those holding messages are listed; offline agents with
// nothing are folded, and the throwaway agents of `relay selfcheck` only counted.
function showAgents(overview) {
  const now = overview.broker.now;
  const held = (a) => a.queued + a.leased + a.delayed + a.failed;
  const busy = (a) => a.online || held(a) > 0 || a.streams > 0 || a.webhook;
  const listed = overview.agents.filter(busy);
  const folded = overview.agents.filter((a) => !busy(a));
  const offline = folded.filter((a) => !a.selfcheck);
  const throwaway = folded.length - offline.length;
  const rows = listed.map((a) => {
    const online = el("td");
    online.append(el("span", null, "dot" + (a.online ? " on" : "")));
    online.append(" " + (a.online ? "online" : a.registered ? "offline" : "never registered"));
    const oldest = el("td", age(a.oldestAgeSeconds), "n");
    if (a.oldestAgeSeconds !== null && a.oldestAgeSeconds > 300) oldest.classList.add("late");
    const name = el("td", null, "name");
    name.append(el("span", a.agent, "cut"));
    name.title = a.agent;
    return [
      name, online, el("td", seen(now, a.lastSeen), "opt"),
      el("td", a.queued, "n"), el("td", a.leased, "n"), el("td", a.delayed, "n opt"),
      el("td", a.failed, "n"), oldest, el("td", a.streams || 0, "n opt"),
      webhookCell(now, a.webhook), cardCell(a.card),
    ];
  });
  fill($("agents").tBodies[0], rows, 11,
    overview.agents.length ? "no agent online" : "no agents yet");
  fill($("offline-agents").tBodies[0], offline.map((a) => {
    const name = el("td", a.agent, "name");
    name.title = a.agent;
    return [name, el("td", seen(now, a.lastSeen)), cardCell(a.card)];
  }), 3, "none");
  $("offline").hidden = !folded.length;
  $("offline-summary").textContent =
    `${offline.length} offline ${plural(offline.length, "agent", "agents")} with no messages` +
    (throwaway ? ` (and ${throwaway} throwaway selfcheck ${plural(throwaway, "agent", "agents")}, not listed)` : "");
  $("agents-count").textContent = overview.agents.length
    ? `${listed.length} listed of ${overview.agentsTotal}` : "";
  $("agents-note").textContent = overview.agentsTotal > overview.agentsListed
    ? `the overview holds the first ${overview.agentsListed} of ${overview.agentsTotal} agents` : "";
}

// The smallest of 1, 2 or 5 times a power of ten that is at least `value`.
// Roles (REACH §13): each role's queue and who holds its leases. Names come from the
// operator's config; they are set as text all the same.
function showRoles(roles) {
  $("roles-section").hidden = !roles.length;
  fill($("roles").tBodies[0], roles.map((r) => [
    el("td", r.name),
    el("td", r.members.join(", ") + (r.selfJoin ? " (open to join)" : "")),
    el("td", String(r.queued), "n"), el("td", String(r.leased), "n"),
    el("td", String(r.delayed), "n opt"), el("td", String(r.failed), "n"),
    el("td", Object.entries(r.leasesBy).map(([m, n]) => `${m} ${n}`).join(", ") || "–"),
  ]), 7, "no roles");
}

function niceTop(value) {
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

function rate(value) {
  if (value === 0) return "0";
  // Quarters of a round top: 0.25, 2.5, 25 are shown as such, never rounded away.
  return String(Number(value.toPrecision(3)));
}

// Drawn in the chart's own pixels (the viewBox is its size), so text is never
// stretched: a grid line and a label at each fifth of a round top value, and a
// time label every 5 minutes.
function showThroughput(points) {
  const chart = $("throughput");
  chart.replaceChildren();
  const W = Math.max(320, Math.round(chart.clientWidth || 900)), H = 220;
  chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const LEFT = 44, RIGHT = 12, TOP = 12, BOTTOM = 26;
  const legend = $("legend");
  legend.replaceChildren();
  for (const [, label, color] of SERIES) {
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = color;
    item.append(swatch, label);
    legend.append(item);
  }
  const end = points.length ? points[points.length - 1].at : Date.now() / 1000;
  const start = end - 900;
  let most = 0;
  for (const p of points) for (const [key] of SERIES) most = Math.max(most, p[key]);
  const top = most > 0 ? niceTop(most) : 1;
  const x = (at) => LEFT + ((at - start) / 900) * (W - LEFT - RIGHT);
  const y = (v) => H - BOTTOM - (v / top) * (H - TOP - BOTTOM);
  for (let i = 0; i <= 4; i++) {
    const value = (top * i) / 4;
    chart.append(svg("line", { x1: LEFT, y1: y(value), x2: W - RIGHT, y2: y(value),
      class: i ? "grid" : "axis" }));
    chart.append(svg("text", { x: LEFT - 6, y: y(value) + 4, "text-anchor": "end",
      class: "tick" }, rate(value) + "/s"));
  }
  for (const minutes of [15, 10, 5, 0]) {
    const at = end - minutes * 60;
    chart.append(svg("line", { x1: x(at), y1: TOP, x2: x(at), y2: H - BOTTOM, class: "grid" }));
    chart.append(svg("text", { x: x(at), y: H - 8, class: "tick",
      "text-anchor": minutes === 15 ? "start" : minutes === 0 ? "end" : "middle" },
      minutes ? `−${minutes} min` : "now"));
  }
  if (points.length < 1) {
    chart.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "note" },
      "collecting samples (every 10 s)…"));
    return;
  }
  for (const [key, , color] of SERIES) {
    const path = points.filter((p) => p.at >= start)
      .map((p, i) => (i ? "L" : "M") + x(p.at).toFixed(1) + "," + y(p[key]).toFixed(1)).join(" ");
    chart.append(svg("path", {
      d: path, fill: "none", stroke: color, "stroke-width": 2, "data-series": key,
    }));
  }
}

// Senders on the left, recipients on the right, a band per pair as thick as its
// share; in the picture's own pixels, with names cut to fit (the full name on hover).
function showFlow(flow) {
  $("flow-since").textContent = flow.since
    ? "since " + new Date(flow.since * 1000).toLocaleTimeString() : "since the broker started";
  const pairs = flow.pairs.slice(0, 40);
  fill($("pairs").tBodies[0], pairs.slice(0, 15).map((p) => [
    el("td", p.from, "name"), el("td", p.to, "name"), el("td", p.count, "n"),
  ]), 3, "no messages in the last minutes");
  const picture = $("flow");
  picture.replaceChildren();
  const senders = [...new Set(pairs.map((p) => p.from))].slice(0, 12);
  const recipients = [...new Set(pairs.map((p) => p.to))].slice(0, 12);
  const rows = Math.max(senders.length, recipients.length, 1);
  const W = Math.max(300, Math.round(picture.clientWidth || 440));
  const H = Math.max(120, 24 + rows * 28);
  picture.setAttribute("viewBox", `0 0 ${W} ${H}`);
  picture.style.height = H + "px";
  if (!pairs.length) {
    picture.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "note" },
      "no messages in the last minutes"));
    return;
  }
  const label = Math.min(170, Math.round(W * 0.3));
  const chars = Math.max(6, Math.floor(label / 7.5));
  const left = label + 8, right = W - label - 8;
  const rowY = (list, name) => 12 + (list.indexOf(name) + 0.5) * ((H - 24) / list.length);
  const most = Math.max(...pairs.map((p) => p.count));
  for (const p of pairs) {
    if (!senders.includes(p.from) || !recipients.includes(p.to)) continue;
    const y1 = rowY(senders, p.from), y2 = rowY(recipients, p.to);
    const middle = (left + right) / 2;
    const band = svg("path", {
      d: `M${left},${y1} C${middle},${y1} ${middle},${y2} ${right},${y2}`, fill: "none",
      stroke: "var(--sent)", "stroke-opacity": 0.45,
      "stroke-width": (1.5 + 9 * p.count / most).toFixed(1),
    });
    band.append(svg("title", {}, `${p.from} → ${p.to}: ${p.count}`));
    picture.append(band);
  }
  const name = (x, y, anchor, text) => {
    const node = svg("text", { x, y: y + 4, "text-anchor": anchor }, shorten(text, chars));
    node.append(svg("title", {}, text));
    picture.append(node);
  };
  for (const n of senders) name(left - 6, rowY(senders, n), "end", n);
  for (const n of recipients) name(right + 6, rowY(recipients, n), "start", n);
}

function showLeases(leases) {
  fill($("leases").tBodies[0], leases.map((m) => {
    const action = el("td");
    const button = el("button", "cancel");
    button.title = "withdraw it: it becomes a dead letter";
    button.addEventListener("click", () => act("/api/cancel", "cancelled", m.id, button));
    action.append(button);
    return [
      idCell(m.id), el("td", `${m.from} → ${m.to}`, "wrap"), el("td", m.attempts, "n"),
      el("td", m.secondsLeft > 0 ? age(m.secondsLeft) : "lapsing", "n"), action,
    ];
  }), 5, "no leases in flight");
}

function showDeadLetters(dead) {
  fill($("dead").tBodies[0], dead.map((m) => {
    const action = el("td");
    const button = el("button", "requeue");
    button.dataset.id = m.id;
    button.addEventListener("click", () => act("/api/requeue", "requeued", m.id, button));
    action.append(button);
    return [
      idCell(m.id), el("td", m.from, "name"), el("td", m.to, "name"),
      el("td", m.attempts, "n"), el("td", m.deliveries, "n opt"),
      el("td", [m.reason, m.error].filter(Boolean).join(": "), "wrap"), action,
    ];
  }), 7, "no dead letters");
}

function showLocks(locks) {
  fill($("locks").tBodies[0], locks.map((lock) => {
    const action = el("td");
    const button = el("button", "unlock");
    button.title = "clear its locks and failure counts, from every address";
    button.addEventListener("click", () => unlock(lock.agent, button));
    action.append(button);
    return [
      el("td", lock.agent), el("td", lock.address === null ? "every address" : lock.address),
      el("td", age(lock.secondsLeft), "n"), action,
    ];
  }), 4, "no agent is locked");
}

async function unlock(agent, button) {
  button.disabled = true;
  try {
    await postJSON("/api/unlock", { agent: agent });
    $("unlock-action").textContent = `unlocked ${agent}`;
  } catch (error) {
    $("unlock-action").textContent = `${agent}: ${error.message}`;
  }
  refresh();
}

async function act(path, done, id, button) {
  button.disabled = true;
  try {
    await postJSON(path, { messageId: id });
    $("action").textContent = `${done} ${id}`;
  } catch (error) {
    $("action").textContent = `${id}: ${error.message}`;
  }
  refresh();
}

let refreshing = false;

async function refresh() {
  if (refreshing) return;
  refreshing = true;
  try {
    const [overview, leases, dead, locks] = await Promise.all([
      getJSON("/api/overview?cards=true"), getJSON("/api/leases"), getJSON("/api/dead-letters"),
      getJSON("/api/locks"),
    ]);
    showBroker(overview);
    showAgents(overview);
    showRoles(overview.roles || []);
    showThroughput(overview.throughput);
    showFlow(overview.flow);
    showLeases(leases.leases);
    showDeadLetters(dead.deadLetters);
    showLocks(locks.locks);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.updated = String(Date.now());
  } catch (error) {
    $("updated").textContent = "cannot reach the broker: " + error.message;
  } finally {
    refreshing = false;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);

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
  $("t-queued").textContent = t.queued;
  $("t-leased").textContent = t.leased;
  $("t-delayed").textContent = t.delayed;
  $("t-failed").textContent = t.failed;
  $("t-sent").textContent = t.sent;
  $("t-delivered").textContent = t.delivered;
  $("t-waiting").textContent = t.pullWaiting;
}

function showAgents(overview) {
  const now = overview.broker.now;
  const rows = overview.agents.map((a) => {
    const online = el("td");
    online.append(el("span", null, "dot" + (a.online ? " on" : "")));
    online.append(" " + (a.online ? "online" : a.registered ? "offline" : "never registered"));
    const oldest = el("td", age(a.oldestAgeSeconds), "n");
    if (a.oldestAgeSeconds !== null && a.oldestAgeSeconds > 300) oldest.classList.add("late");
    const card = el("td");
    if (a.card) {
      if (a.card.description) card.append(el("div", a.card.description));
      if (a.card.skills && a.card.skills.length) {
        card.append(el("div", a.card.skills.join(", "), "card-skills"));
      }
    }
    return [
      el("td", a.agent), online,
      el("td", a.lastSeen === null ? "–" : age(now - a.lastSeen) + " ago"),
      el("td", a.queued, "n"), el("td", a.leased, "n"), el("td", a.delayed, "n"),
      el("td", a.failed, "n"), oldest, card,
    ];
  });
  fill($("agents").tBodies[0], rows, 9, "no agents yet");
  $("agents-note").textContent = overview.agentsTotal > overview.agentsListed
    ? `showing ${overview.agentsListed} of ${overview.agentsTotal} agents` : "";
}

function showThroughput(points) {
  const chart = $("throughput");
  chart.replaceChildren();
  const W = 900, H = 200, PAD = 24;
  const legend = $("legend");
  legend.replaceChildren();
  for (const [, label, color] of SERIES) {
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = color;
    item.append(swatch, label);
    legend.append(item);
  }
  if (points.length < 1) {
    chart.append(svg("text", { x: 20, y: 100 }, "collecting samples…"));
    return;
  }
  const end = points[points.length - 1].at;
  const start = end - 900;
  let top = 0.001;
  for (const p of points) for (const [key] of SERIES) top = Math.max(top, p[key]);
  const x = (at) => PAD + ((at - start) / 900) * (W - 2 * PAD);
  const y = (v) => H - PAD - (v / top) * (H - 2 * PAD);
  chart.append(svg("line", { x1: PAD, y1: H - PAD, x2: W - PAD, y2: H - PAD, class: "axis" }));
  chart.append(svg("text", { x: 2, y: PAD }, top.toFixed(top < 10 ? 2 : 0) + "/s"));
  chart.append(svg("text", { x: PAD, y: H - 6 }, "−15 min"));
  chart.append(svg("text", { x: W - PAD - 24, y: H - 6 }, "now"));
  for (const [key, , color] of SERIES) {
    const path = points.filter((p) => p.at >= start)
      .map((p, i) => (i ? "L" : "M") + x(p.at).toFixed(1) + "," + y(p[key]).toFixed(1)).join(" ");
    chart.append(svg("path", {
      d: path, fill: "none", stroke: color, "stroke-width": 2, "data-series": key,
    }));
  }
}

function showFlow(flow) {
  $("flow-since").textContent = flow.since
    ? "since " + new Date(flow.since * 1000).toLocaleTimeString() : "since the broker started";
  const pairs = flow.pairs.slice(0, 40);
  fill($("pairs").tBodies[0], pairs.slice(0, 15).map((p) => [
    el("td", p.from), el("td", p.to), el("td", p.count, "n"),
  ]), 3, "no messages in the last minutes");
  const picture = $("flow");
  picture.replaceChildren();
  if (!pairs.length) return;
  const senders = [...new Set(pairs.map((p) => p.from))].slice(0, 12);
  const recipients = [...new Set(pairs.map((p) => p.to))].slice(0, 12);
  const rowY = (list, name) => 20 + (list.indexOf(name) + 0.5) * (200 / list.length);
  const most = Math.max(...pairs.map((p) => p.count));
  for (const p of pairs) {
    if (!senders.includes(p.from) || !recipients.includes(p.to)) continue;
    const y1 = rowY(senders, p.from), y2 = rowY(recipients, p.to);
    picture.append(svg("path", {
      d: `M110,${y1} C220,${y1} 220,${y2} 330,${y2}`, fill: "none",
      stroke: "var(--sent)", "stroke-opacity": 0.45,
      "stroke-width": (1 + 9 * p.count / most).toFixed(1),
    }));
  }
  for (const name of senders) {
    picture.append(svg("text", { x: 104, y: rowY(senders, name) + 4, "text-anchor": "end" }, name));
  }
  for (const name of recipients) {
    picture.append(svg("text", { x: 336, y: rowY(recipients, name) + 4 }, name));
  }
}

function showLeases(leases) {
  fill($("leases").tBodies[0], leases.map((m) => {
    const action = el("td");
    const button = el("button", "cancel");
    button.title = "withdraw it: it becomes a dead letter";
    button.addEventListener("click", () => act("/api/cancel", "cancelled", m.id, button));
    action.append(button);
    return [
      el("td", m.id, "id"), el("td", `${m.from} → ${m.to}`), el("td", m.attempts, "n"),
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
      el("td", m.id, "id"), el("td", m.from), el("td", m.to), el("td", m.attempts, "n"),
      el("td", m.deliveries, "n"), el("td", [m.reason, m.error].filter(Boolean).join(": ")),
      action,
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

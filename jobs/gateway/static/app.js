// slotq dashboard: polls the gateway's small JSON API and runs a chat playground whose stream
// survives a page reload (the last SSE event id is kept in localStorage and sent back as
// Last-Event-ID). No build step, no dependencies.
//
// The gateway sends a Content-Security-Policy without 'unsafe-inline': nothing here writes a style
// attribute into HTML (bar widths and colours are set through element.style after rendering) and
// nothing runs inline script. The API key lives in sessionStorage: it survives a reload of this
// tab (so a reply resumes) but not the browser session, and other tabs and sites never see it.
"use strict";

const $ = (sel) => document.querySelector(sel);
const PLAY_KEY = "slotq.playground";
const API_KEY = "slotq.apiKey";
localStorage.removeItem(API_KEY);          // where earlier versions kept it, for good

// ------------------------------------------------------------------ HTTP
function headers(extra = {}) {
  const key = sessionStorage.getItem(API_KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers || {}) });
  if (response.status === 401) {
    $("#key-form").hidden = false;
    throw new Error("API key needed");
  }
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(API_KEY, $("#key").value.trim());
  $("#key-form").hidden = true;
  refresh();
});

// ------------------------------------------------------------------ formatting
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const ago = (seconds) => seconds == null ? "–" : seconds < 1 ? "now" : seconds < 90 ? `${seconds.toFixed(0)} s` : `${(seconds / 60).toFixed(0)} min`;
// speculative decoding: "ngram 62 %" and its counts, or the source alone ("off") before any draft
const drafts = (w) => w.spec_acceptance == null ? esc(w.spec)
  : `${esc(w.spec)} ${(100 * w.spec_acceptance).toFixed(0)} % <span class="muted small">${w.spec_accepted_tokens} / ${w.spec_draft_tokens}</span>`;
const bar = (used, total, cls = "") => {
  const pct = total ? Math.min(100, (100 * used) / total) : 0;
  return `<span class="bar ${cls}"><span data-width="${pct}"></span></span>`;
};

// innerHTML, then the styles the markup names (data-width: a bar's %, data-color: a swatch) through
// the CSSOM, which the page's Content-Security-Policy allows where style attributes are refused.
function render(selector, html) {
  const root = $(selector);
  root.innerHTML = html;
  for (const node of root.querySelectorAll("[data-width]")) node.style.width = `${node.dataset.width}%`;
  for (const node of root.querySelectorAll("[data-color]")) node.style.background = node.dataset.color;
}

// ------------------------------------------------------------------ fleet
function renderFleet(fleet) {
  const lanes = (q) => q.lanes.map((l) => `<span class="lane">${esc(l.lane)} ${l.queued}·${l.running}</span>`).join(" ");
  render("#queues tbody", fleet.queues.map((q) => `
    <tr data-queue="${esc(q.queue)}"><td>${esc(q.queue)}</td><td>${esc(q.models.join(", ") || "–")}</td>
      <td class="num">${q.workers}</td><td>${bar(q.slots_busy, q.slots_total)}${q.slots_busy} / ${q.slots_total}</td>
      <td class="num">${q.queued}</td><td class="num">${q.running}</td><td class="num">${q.deferred}</td>
      <td class="num">${ago(q.oldest_queued_age_s)}</td><td>${lanes(q)}</td></tr>`).join(""));
  render("#workers tbody", fleet.workers.map((w) => {
    const kv = w.kv_cells_total ? `${bar(w.kv_cells_used, w.kv_cells_total, "kv")}${((100 * w.kv_cells_used) / w.kv_cells_total).toFixed(0)} %` : "–";
    return `<tr data-worker="${esc(w.id)}"><td>${esc(w.id)}</td><td>${esc(w.model)}</td><td>${esc(w.queue)}</td>
      <td class="slots">${bar(w.slots_busy, w.slots_total)}${w.slots_busy} / ${w.slots_total}</td><td>${kv}</td>
      <td class="num">${w.tokens_per_s.toFixed(1)}</td><td class="num">${w.generated_tokens}</td><td class="spec">${drafts(w)}</td>
      <td class="num">${w.waiting}</td><td class="num">${ago(fleet.time - w.updated_at)}</td></tr>`;
  }).join(""));
  $("#no-workers").hidden = fleet.workers.length > 0;
  const badge = $("#dlq-count");
  badge.textContent = fleet.dead_letters;
  badge.className = fleet.dead_letters ? "badge bad" : "badge";
}

async function refreshDeadLetters() {
  const { data } = await api("/api/dead-letters");
  $("#dead-letters tbody").innerHTML = data.map((d) => `
    <tr data-job="${esc(d.job_id)}"><td><code>${esc(d.job_id)}</code></td>
      <td class="err">${esc(d.error.code)}: ${esc(d.error.message)}</td><td class="num">${d.attempts}</td>
      <td>${ago(Date.now() / 1000 - d.dead_at)}</td>
      <td><button class="secondary requeue" data-job="${esc(d.job_id)}">Requeue</button></td></tr>`).join("");
  $("#no-dead-letters").hidden = data.length > 0;
}

$("#dead-letters").addEventListener("click", async (event) => {
  const button = event.target.closest("button.requeue");
  if (!button) return;
  button.disabled = true;
  try {
    await api(`/api/dead-letters/${encodeURIComponent(button.dataset.job)}/requeue`, { method: "POST" });
  } catch (err) {
    alert(`requeue failed: ${err.message}`);
  }
  refreshDeadLetters();
});

// ------------------------------------------------------------------ webhooks
// /api/webhook-attempts: every tenant's last delivery attempts, newest first.
async function refreshWebhookAttempts() {
  const { data } = await api("/api/webhook-attempts");
  const now = Date.now() / 1000;
  $("#webhook-attempts tbody").innerHTML = data.map((a) => `
    <tr data-webhook="${esc(a.webhook_id)}" class="${esc(a.outcome)}"><td>${ago(now - a.attempted_at)}</td>
      <td>${esc(a.tenant)}</td><td><code>${esc(a.endpoint_id)}</code></td>
      <td>${esc(a.event_type)} <code class="muted small">${esc(a.event_id)}</code></td><td class="num">${a.attempt}</td>
      <td class="${a.error ? "err" : ""}">${esc(a.error || `HTTP ${a.status_code}`)} <span class="muted small">${a.duration_ms} ms</span></td>
      <td>${esc(a.outcome)}</td><td>${a.next_attempt_at == null ? "–" : `in ${ago(a.next_attempt_at - now)}`}</td></tr>`).join("");
  $("#no-webhook-attempts").hidden = data.length > 0;
}

// ------------------------------------------------------------------ lanes over time
// /api/history: a sample every few seconds over the last 15 minutes (the gateway's ring buffer).
// Drawn as inline SVG: one line per lane, a shared time axis ending now.
const SVG = "http://www.w3.org/2000/svg";
const LANE_COLORS = ["#2f6fde", "#d98e04", "#1f9d55", "#8e44ad", "#d64545", "#16a2b8"];
const CHART = { width: 360, height: 150, left: 34, right: 6, top: 8, bottom: 18 };

function niceMax(value) {
  if (value <= 0) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * step).find((m) => m >= value);
}

function svgNode(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

// series: [{ name, color, points: [[time, value], ...] }]; bars: draw each point as a bar, not a line.
function drawChart(svg, series, { now, span, bars = false }) {
  const { width, height, left, right, top, bottom } = CHART;
  const plotW = width - left - right, plotH = height - top - bottom;
  const peak = Math.max(0, ...series.flatMap((s) => s.points.map(([, v]) => v)));
  const yMax = niceMax(peak);
  const x = (t) => left + plotW * (1 - (now - t) / span);
  const y = (v) => top + plotH * (1 - v / yMax);
  svg.replaceChildren();
  for (const v of [0, yMax / 2, yMax]) {
    svg.append(svgNode("line", { class: "grid", x1: left, x2: width - right, y1: y(v), y2: y(v) }));
    svg.append(svgNode("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" }, Number(v.toPrecision(3))));
  }
  for (const minutes of [15, 10, 5, 0]) {
    const label = minutes ? `-${minutes} min` : "now";
    svg.append(svgNode("text", { x: x(now - minutes * 60), y: height - 5, "text-anchor": minutes ? "middle" : "end" }, label));
  }
  const barW = Math.max(1.5, plotW / (span / 5) / Math.max(1, series.length));
  series.forEach((s, i) => {
    const visible = s.points.filter(([t]) => now - t <= span);
    if (bars) {
      for (const [t, v] of visible.filter(([, v]) => v > 0)) {
        svg.append(svgNode("rect", { x: x(t) - barW * (series.length - i), y: y(v), width: barW, height: y(0) - y(v), fill: s.color }));
      }
    } else if (visible.length) {
      svg.append(svgNode("polyline", { stroke: s.color, points: visible.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ") }));
    }
  });
  svg.dataset.points = Math.max(0, ...series.map((s) => s.points.length));
  svg.dataset.max = peak;
}

function renderHistory(history) {
  const samples = history.samples;
  const lanes = [...new Set(samples.flatMap((s) => Object.keys(s.lanes)))];
  const color = (lane) => LANE_COLORS[lanes.indexOf(lane) % LANE_COLORS.length];
  const now = samples.length ? samples[samples.length - 1].time : Date.now() / 1000;
  const series = (field) => lanes.map((lane) => ({
    name: lane, color: color(lane),
    points: samples.filter((s) => s.lanes[lane]).map((s) => [s.time, s.lanes[lane][field]]),
  }));
  // preemptions: the increase of each lane's running total from one sample to the next
  const preempted = series("preempted").map((s) => ({
    ...s, points: s.points.slice(1).map(([t, v], i) => [t, Math.max(0, v - s.points[i][1])]),
  }));
  const span = history.keep_s;
  drawChart($("#chart-tokens"), series("tokens_per_s"), { now, span });
  drawChart($("#chart-waiting"), series("waiting"), { now, span });
  drawChart($("#chart-preempted"), preempted, { now, span, bars: true });
  const last = samples.length ? samples[samples.length - 1].lanes : {};
  render("#lane-legend", lanes.map((lane, i) => {
    const l = last[lane] || { tokens_per_s: 0, waiting: 0, running: 0 };
    const window = preempted[i].points.reduce((sum, [, v]) => sum + v, 0);
    return `<span data-lane="${esc(lane)}"><span class="swatch" data-color="${color(lane)}"></span><b>${esc(lane)}</b>
      ${l.tokens_per_s.toFixed(1)} tok/s · ${l.waiting} waiting · ${l.running} running · ${window} preempted in 15 min</span>`;
  }).join("") || `<span class="muted">No samples yet (one every ${history.every_s} s).</span>`);
  const tenants = Object.entries(history.tenants_waiting);
  const most = Math.max(1, ...tenants.map(([, n]) => n));
  render("#tenants tbody", tenants.map(([tenant, n]) => `
    <tr data-tenant="${esc(tenant)}"><td>${esc(tenant)}</td><td>${bar(n, most)}${n}</td></tr>`).join("")
    || `<tr><td class="muted" colspan="2">No job waiting.</td></tr>`);
}

async function refreshHistory() {
  renderHistory(await api("/api/history"));
}

// ------------------------------------------------------------------ cluster shards
// /api/shards: on a Redis Cluster, each primary and its share of the gateway's queue (slotq status' shard
// table), read by the gateway at most every few seconds however many pages ask; hidden on one Redis.
const share = (x) => x == null ? "–" : `${(100 * x).toFixed(x < 0.1 ? 1 : 0)} %`;      // an idle shard's CPU: "0.4 %"
const mebibytes = (n) => `${(n / 2 ** 20).toFixed(1)} MiB`;
// "0–5460", or the first two runs and how many more (all of them in the tooltip)
function slotRanges(ranges) {
  const runs = ranges.map(([first, last]) => first === last ? `${first}` : `${first}–${last}`);
  const shown = runs.length > 3 ? `${runs.slice(0, 2).join(", ")} +${runs.length - 2} more` : runs.join(", ");
  const slots = ranges.reduce((n, [first, last]) => n + last - first + 1, 0);
  return `<span title="${esc(runs.join(", "))}">${esc(shown)}</span> <span class="muted small">${slots} slots</span>`;
}

function renderShards(answer) {
  const section = $("#shards");
  section.hidden = !answer.clustered;
  section.dataset.clustered = answer.clustered;
  $("#shards-queue").textContent = answer.queue;
  const buckets = answer.shards.reduce((n, s) => n + s.stream_slots.length, 0);
  render("#shards tbody", answer.shards.map((s) => {
    const holds = [
      s.queue_slot == null ? "" : `<span class="lane mark queue-slot">queue · slot ${s.queue_slot}</span>`,
      s.partitions.length ? `<span class="lane mark partitions">partition${s.partitions.length > 1 ? "s" : ""} ${s.partitions.join(", ")}</span>` : "",
      `<span class="lane buckets">${s.stream_slots.length} / ${buckets} stream buckets</span>`,
      s.queues.length ? `<span class="muted small">${esc(s.queues.join(", "))}</span>` : "",
    ];
    return `<tr data-node="${esc(s.node)}"><td>${esc(s.node)}</td><td>${slotRanges(s.slots)}</td>
      <td class="num">${s.keys}</td><td class="num">${mebibytes(s.used_memory_bytes)}</td>
      <td>${bar(s.ops_share || 0, 1)}${s.ops_per_s} <span class="muted small">${share(s.ops_share)}</span></td>
      <td class="num">${share(s.cpu_share)}</td><td class="num">${s.clients}</td><td class="num">${s.replicas}</td>
      <td class="holds">${holds.join(" ")}</td></tr>`;
  }).join(""));
}

async function refreshShards() {
  renderShards(await api("/api/shards"));
}

async function refreshModels() {
  const { data } = await api("/v1/models");
  const select = $("#play-model");
  const chosen = select.value;
  select.innerHTML = data.map((m) => `<option>${esc(m.id)}</option>`).join("");
  if (data.some((m) => m.id === chosen)) select.value = chosen;
}

async function refresh() {
  const conn = $("#conn");
  try {
    renderFleet(await api("/api/fleet"));
    conn.textContent = `live · ${new Date().toLocaleTimeString()}`;
    conn.className = "conn ok";
  } catch (err) {
    conn.textContent = `gateway unreachable: ${err.message}`;
    conn.className = "conn bad";
  }
}

// ------------------------------------------------------------------ playground
// State kept in localStorage after every event: the request, the text so far and the id of the
// last event it includes. Text and id are written together, so a reload resumes exactly there.
const load = () => JSON.parse(localStorage.getItem(PLAY_KEY) || "null");
const save = (state) => localStorage.setItem(PLAY_KEY, JSON.stringify(state));

function status(text) { $("#play-status").textContent = text; }

function busy(on) {
  $("#play-send").disabled = on;
  $("#play-stop").disabled = !on;
}

// Minimal SSE parsing over fetch (EventSource cannot POST or send an Authorization header).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const event = { id: null, data: [] };
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue;                 // keep-alive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "id") event.id = value;
        else if (field === "data") event.data.push(value);
      }
      if (event.data.length) yield { id: event.id, data: event.data.join("\n") };
    }
  }
}

async function runStream(state) {
  busy(true);
  const output = $("#play-output");
  output.textContent = state.text;
  const extra = { "Content-Type": "application/json" };
  if (state.lastId) extra["Last-Event-ID"] = state.lastId;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(extra), body: JSON.stringify(state.request) });
    if (!response.ok) {
      const body = await response.json();
      throw new Error(body.error ? body.error.message : response.statusText);
    }
    for await (const event of sseEvents(response)) {
      if (event.data === "[DONE]") {
        state.done = true;
        break;
      }
      const chunk = JSON.parse(event.data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices) {
        if (choice.delta.content) state.text += choice.delta.content;
        if (choice.finish_reason) state.finish = choice.finish_reason;
      }
      if (chunk.usage) state.usage = chunk.usage;
      if (event.id) state.lastId = event.id;
      output.textContent = state.text;
      save(state);
      status(`job ${state.request.idempotency_key} · event ${state.lastId || "–"}${state.resumed ? " · resumed after reload" : ""}`);
    }
    if (!state.done) throw new Error("the stream ended early; reload to resume");
    const usage = state.usage ? ` · ${state.usage.completion_tokens} tokens` : "";
    status(`done (${state.finish})${usage} · job ${state.request.idempotency_key}${state.resumed ? " · resumed after reload" : ""}`);
  } catch (err) {
    state.done = true;
    status(`error: ${err.message}`);
  } finally {
    save(state);
    busy(false);
  }
}

$("#play-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = `play-${Date.now()}-${Math.random().toString(36).slice(2, 10)}`;
  const state = {
    request: {
      model: $("#play-model").value,
      messages: [{ role: "user", content: $("#play-prompt").value }],
      max_tokens: Number($("#play-max").value),
      temperature: Number($("#play-temp").value),
      ignore_eos: $("#play-ignore-eos").checked,
      stream: true,
      stream_options: { include_usage: true },
      keep_on_disconnect: true,          // a reload must not cancel the job
      idempotency_key: key,              // ... and Last-Event-ID finds it again by this key
    },
    text: "", lastId: null, done: false, resumed: false,
  };
  save(state);
  status(`job ${key} queued`);
  runStream(state);
});

$("#play-stop").addEventListener("click", async () => {
  const state = load();
  if (state) await api(`/v1/jobs/${encodeURIComponent(state.request.idempotency_key)}`, { method: "DELETE" });
});

// ------------------------------------------------------------------ start
function start() {
  refresh();
  refreshModels().catch(() => {});
  refreshDeadLetters().catch(() => {});
  refreshWebhookAttempts().catch(() => {});
  refreshHistory().catch(() => {});
  refreshShards().catch(() => {});
  setInterval(refresh, 1000);
  setInterval(() => refreshHistory().catch(() => {}), 5000);
  setInterval(() => refreshShards().catch(() => {}), 5000);     // the gateway reads them at most every 4 s
  setInterval(() => refreshModels().catch(() => {}), 5000);
  setInterval(() => refreshDeadLetters().catch(() => {}), 3000);
  setInterval(() => refreshWebhookAttempts().catch(() => {}), 3000);
  const state = load();
  if (state) {
    $("#play-prompt").value = state.request.messages[0].content;
    if (!state.done) {
      state.resumed = true;
      status(`resuming job ${state.request.idempotency_key} after event ${state.lastId || "(start)"}`);
      runStream(state);
    } else {
      $("#play-output").textContent = state.text;
    }
  }
}

start();

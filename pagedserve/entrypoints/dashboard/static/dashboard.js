// pagedserve's dashboard and playground: plain JavaScript, no dependencies.
// One SSE stream (/dashboard/events) brings a full picture of the KV block pool, then
// only the blocks that changed, the request queues and per-second series points.
"use strict";

const KEY_STORAGE = "pagedserve-api-key";
const SERIES_SECONDS = 300;

// Everything the page knows, on window for tests and the curious.
const state = {
  numBlocks: 0, blockSize: 0, nullId: 0,
  refs: new Int32Array(0), hashes: [],
  counts: { used: 0, shared: 0, cached: 0, free: 0 },
  maxInUseSeen: 0,
  running: [], waiting: [], numRunning: 0, numWaiting: 0,
  series: [], config: {}, events: 0, fullEvents: 0,
  costSeconds: 0, costSince: null,  // the server's seconds spent on this page's data; [time, cost] at the start
};
window.pagedserve = state;

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---------------------------------------------------------------- auth
// The key lives as long as the tab (sessionStorage): never kept on disk for whoever uses
// this browser profile later.
function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }
function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}
let keyWaiters = [];
function needKey() {  // (after a 401: a key sent was refused, or none was)
  $("key-form").hidden = false;
  setStatus(apiKey() ? "the server refused this API key (401): enter the right one" : "this server needs an API key",
            "error");
  return new Promise((resolve) => keyWaiters.push(resolve));
}
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
  $("key-form").hidden = true;
  const waiters = keyWaiters; keyWaiters = [];
  waiters.forEach((w) => w());
});

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + (cls || "");
}

// ---------------------------------------------------------------- SSE over fetch
// EventSource cannot send an Authorization header, so streams are read by hand.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

// ---------------------------------------------------------------- tabs
document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
  document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.id === tab.dataset.tab));
  if (tab.dataset.tab === "dashboard") { layoutPool(); drawCharts(); }
}));

// ---------------------------------------------------------------- the block pool
const COLORS = {};
for (const name of ["free", "cached", "used", "shared", "null"]) {
  COLORS[name] = getComputedStyle(document.documentElement).getPropertyValue("--" + name).trim();
}
function kindOf(id, ref, hash) {
  if (id === state.nullId) return "null";
  if (ref >= 2) return "shared";
  if (ref === 1) return "used";
  return hash ? "cached" : "free";
}
const pool = { cell: 8, gap: 1, cols: 1 };
function layoutPool() {
  const canvas = $("pool");
  const width = canvas.parentElement.clientWidth || 600;
  const n = Math.max(state.numBlocks, 1);
  let cell = 2;
  for (const s of [16, 12, 10, 8, 6, 5, 4, 3, 2]) {
    if (Math.ceil(n / Math.floor(width / s)) * s <= 360) { cell = s; break; }
  }
  pool.cell = cell;
  pool.gap = cell >= 5 ? 1 : 0;
  pool.cols = Math.max(1, Math.floor(width / cell));
  canvas.width = pool.cols * cell;
  canvas.height = Math.ceil(n / pool.cols) * cell;
  canvas.style.height = canvas.height + "px";
  canvas.style.width = canvas.width + "px";
  for (let i = 0; i < state.numBlocks; i++) drawCell(i);
}
function drawCell(id) {
  const ctx = $("pool").getContext("2d");
  const x = (id % pool.cols) * pool.cell, y = Math.floor(id / pool.cols) * pool.cell;
  ctx.fillStyle = COLORS[kindOf(id, state.refs[id], state.hashes[id])];
  ctx.fillRect(x, y, pool.cell - pool.gap, pool.cell - pool.gap);
}
function count(id, sign) {
  const kind = kindOf(id, state.refs[id], state.hashes[id]);
  if (kind !== "null") state.counts[kind] += sign;
}
function showCounts() {
  for (const k of ["used", "shared", "cached", "free"]) {
    const el = $("count-" + k), text = String(state.counts[k]);
    if (el.textContent !== text) el.textContent = text;
  }
  state.maxInUseSeen = Math.max(state.maxInUseSeen, state.counts.used + state.counts.shared);
}
function holders(id) {
  const out = [];
  for (const r of state.running.concat(state.waiting)) if (r.block_ids.includes(id)) out.push(r.request_id);
  return out;
}
$("pool").addEventListener("mousemove", (e) => {
  const rect = e.target.getBoundingClientRect();
  const col = Math.floor((e.clientX - rect.left) / pool.cell), row = Math.floor((e.clientY - rect.top) / pool.cell);
  const id = row * pool.cols + col;
  const tip = $("tooltip");
  if (col >= pool.cols || id >= state.numBlocks) { tip.hidden = true; return; }
  const ref = state.refs[id], hash = state.hashes[id], who = holders(id);
  tip.textContent = `block ${id} (${kindOf(id, ref, hash)})\nref_cnt ${ref}\nhash ${hash || "-"}` +
    (id === state.nullId ? "\npads block tables; never allocated" : "") +
    `\nheld by ${who.length ? who.join(", ") : "no listed request"}`;
  tip.style.left = (e.clientX - rect.left + 12) + "px";
  tip.style.top = (e.clientY - rect.top + 12) + "px";
  tip.hidden = false;
});
$("pool").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });

// ---------------------------------------------------------------- queues and config
const rendered = {};  // the rows each table shows now, as JSON: unchanged tables are not rebuilt
function renderQueue(tbodyId, rows, total) {
  const key = JSON.stringify([rows, total]);
  if (rendered[tbodyId] === key) return;
  rendered[tbodyId] = key;
  const body = $(tbodyId);
  body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    const cells = [r.request_id, r.state, r.prompt_len, r.num_computed_tokens, r.num_output_tokens, r.block_ids.length];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      td.textContent = v;
      if (i === 0) td.title = v;
      if (i === 1) td.className = "state-" + v;
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  if (total > rows.length) {
    const tr = document.createElement("tr");
    tr.className = "more";
    tr.innerHTML = `<td colspan="6"></td>`;
    tr.firstChild.textContent = `… and ${total - rows.length} more`;
    body.appendChild(tr);
  }
}
function renderConfig(config) {
  const table = $("config");
  table.replaceChildren();
  for (const [k, v] of Object.entries(config)) {
    const tr = table.insertRow();
    tr.insertCell().textContent = k.replaceAll("_", " ");
    tr.insertCell().textContent = v;
  }
  $("model-name").textContent = config.served_model_name || config.model || "";
  // A pooling model answers no chat: its playground would send requests only to be refused.
  const pooling = config.runner === "pooling";
  $("tab-playground").hidden = pooling;
  if (pooling && $("playground").classList.contains("active")) $("tab-dashboard").click();
}

// ---------------------------------------------------------------- charts
const CHARTS = [
  { id: "throughput", title: "Throughput (tokens/s)", lines: [["gen_tps", "generation", 1], ["prompt_tps", "prompt", 1]] },
  { id: "kv", title: "KV cache usage (%)", lines: [["kv_usage", "usage", 100]], max: 100 },
  { id: "hit", title: "Prefix cache hit rate (%)", lines: [["hit_rate", "hit rate", 100]], max: 100 },
  { id: "ttft", title: "Time to first token (s)", lines: [["ttft_p50", "p50", 1], ["ttft_p95", "p95", 1]] },
  { id: "itl", title: "Inter-token latency (ms)", lines: [["itl_p50", "p50", 1000], ["itl_p95", "p95", 1000]] },
  { id: "requests", title: "Requests", lines: [["running", "running", 1], ["waiting", "waiting", 1], ["preemptions", "preemptions/s", 1]] },
];
const LINE_COLORS = ["#2563eb", "#f59e0b", "#16a34a"];
for (const c of CHARTS) {
  const div = document.createElement("div");
  div.className = "card chart";
  div.id = "chart-" + c.id;
  div.innerHTML = `<h2></h2><canvas></canvas>`;
  div.querySelector("h2").textContent = c.title;
  const now = document.createElement("span");
  now.className = "now";
  div.querySelector("h2").appendChild(now);
  $("charts").appendChild(div);
}
function drawCharts() {
  const pts = state.series;
  const tEnd = pts.length ? pts[pts.length - 1].t : Date.now() / 1000;
  for (const c of CHARTS) {
    const div = $("chart-" + c.id), canvas = div.querySelector("canvas");
    const w = canvas.clientWidth || 340, h = canvas.clientHeight || 120;
    canvas.width = w; canvas.height = h;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, w, h);
    let max = c.max || 0;
    for (const [key, , scale] of c.lines) for (const p of pts) if (p[key] != null) max = Math.max(max, p[key] * scale);
    max = max || 1;
    ctx.strokeStyle = "#e3e6ea"; ctx.fillStyle = "#6b7280"; ctx.font = "10px system-ui";
    ctx.beginPath(); ctx.moveTo(0, h - 12.5); ctx.lineTo(w, h - 12.5); ctx.stroke();
    ctx.fillText(max.toPrecision(3), 2, 10);
    ctx.fillText(`-${SERIES_SECONDS / 60} min`, 2, h - 2);
    const latest = [];
    c.lines.forEach(([key, label, scale], i) => {
      ctx.strokeStyle = LINE_COLORS[i]; ctx.lineWidth = 1.5; ctx.beginPath();
      let pen = false, last = null;
      for (const p of pts) {
        const v = p[key];
        if (v == null) { pen = false; continue; }
        const x = w - (tEnd - p.t) / SERIES_SECONDS * w, y = (h - 14) - (v * scale) / max * (h - 26);
        if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        pen = true; last = v * scale;
      }
      ctx.stroke();
      div.dataset[key] = last == null ? "" : String(last);
      latest.push(`${label} ${last == null ? "–" : +last.toPrecision(3)}`);
    });
    div.querySelector(".now").textContent = latest.join(" · ");
  }
}

// ---------------------------------------------------------------- the event stream
function apply(ev) {
  if (ev.type === "error") { setStatus(ev.message, "error"); return; }  // (too many pages open: the stream ends)
  state.events += 1;
  if (ev.type === "full") {
    state.fullEvents += 1;
    state.numBlocks = ev.num_blocks; state.blockSize = ev.block_size; state.nullId = ev.null_block_id;
    state.refs = new Int32Array(ev.num_blocks); state.hashes = new Array(ev.num_blocks).fill(null);
    state.counts = { used: 0, shared: 0, cached: 0, free: 0 };
    for (const [id, ref, hash] of ev.blocks) { state.refs[id] = ref; state.hashes[id] = hash; count(id, 1); }
    state.series = ev.series;
    state.config = ev.config;
    if (!pageModel && ev.config.served_model_name) modelName = ev.config.served_model_name;
    renderConfig(ev.config);
    $("pool-title").textContent = `${ev.num_blocks} blocks × ${ev.block_size} tokens`;
    layoutPool();
  } else {
    for (const [id, ref, hash] of ev.blocks) {
      count(id, -1);
      state.refs[id] = ref; state.hashes[id] = hash;
      count(id, 1);
      drawCell(id);
    }
    state.series = state.series.concat(ev.series).slice(-SERIES_SECONDS);
  }
  showCounts();
  state.costSeconds = ev.cost_seconds;
  const now = performance.now() / 1000;
  if (ev.type === "full" || !state.costSince) state.costSince = [now, ev.cost_seconds];
  if (now - state.costSince[0] > 2) {
    const ms = 1000 * (ev.cost_seconds - state.costSince[1]) / (now - state.costSince[0]);
    $("cost").textContent = `this page costs the server ${ms.toFixed(2)} ms/s (${(ms / 10).toFixed(3)}%)`;
  }
  state.running = ev.running; state.waiting = ev.waiting;
  state.numRunning = ev.num_running; state.numWaiting = ev.num_waiting;
  $("running-count").textContent = ev.num_running;
  $("waiting-count").textContent = ev.num_waiting;
  renderQueue("running", ev.running, ev.num_running);
  renderQueue("waiting", ev.waiting, ev.num_waiting);
  if (ev.type === "full" || ev.series.length) drawCharts();
}

// A hidden tab closes its event stream and opens it again when shown: a browser opens six
// connections to a host, and six background tabs' streams left none for a seventh page
// (it never loaded) or for the playground's requests.
let eventsAbort = null;
function whenVisible() {
  return new Promise((resolve) => {
    if (!document.hidden) return resolve();
    const shown = () => { if (!document.hidden) { document.removeEventListener("visibilitychange", shown); resolve(); } };
    document.addEventListener("visibilitychange", shown);
  });
}
document.addEventListener("visibilitychange", () => {
  if (document.hidden && eventsAbort) { eventsAbort.abort(); setStatus("paused while the tab is hidden", ""); }
});
async function watch() {
  for (;;) {
    await whenVisible();
    eventsAbort = new AbortController();
    try {
      const r = await fetch("/dashboard/events" + (pageModel ? "?model=" + encodeURIComponent(pageModel) : ""),
                            { headers: authHeaders(), signal: eventsAbort.signal });
      if (r.status === 401) { await needKey(); continue; }
      if (!r.ok) {  // the server's reason (loading, too many pages open, ...)
        let why = `server answered ${r.status}`;
        try { why += ": " + (await r.json()).error.message; } catch (e) { /* no JSON body */ }
        setStatus(why, "error");
      } else {
        setStatus("live", "live");
        loadModelName();
        let ended = "stream ended, reconnecting…";
        for await (const data of sseData(r)) {
          const ev = JSON.parse(data);
          if (ev.type === "error") ended = `${ev.message}; retrying…`;  // (kept: the stream ends next)
          apply(ev);
        }
        setStatus(ended, "error");
      }
    } catch (e) {
      if (e.name === "AbortError") continue;  // (hidden: waits to be shown)
      setStatus("disconnected, retrying…", "error");
    }
    await sleep(1000);
  }
}

// ---------------------------------------------------------------- playground
// A server of several models shows one model's pool per page: ?model=NAME picks it.
const pageModel = new URLSearchParams(location.search).get("model");
let modelName = pageModel;
const conversation = [];
// The reply streaming now (Stop and Clear abort it) and the chat's epoch: a reply of a
// chat cleared since it was sent is never added to the conversation the next one sends.
let replying = null, chatEpoch = 0;
async function loadModelName() {
  try {
    const r = await fetch("/v1/models", { headers: authHeaders() });
    if (!r.ok) return;
    const ids = (await r.json()).data.filter(m => !m.parent).map(m => m.id);
    modelName = pageModel || state.config.served_model_name || ids[0];
    const list = $("models");
    list.textContent = "";
    if (ids.length < 2) return;
    for (const id of ids) {  // the other models' pages
      const a = document.createElement("a");
      a.href = "?model=" + encodeURIComponent(id);
      a.textContent = id;
      if (id === modelName) a.className = "current";
      list.append(" ", a);
    }
  } catch (e) { /* shown when sending */ }
}
// The request's sampling fields: a blank one is left out (the server's default), never sent as 0.
function samplingBody() {
  const body = { model: modelName };
  for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  return body;
}
function messagesWith(userContent) {
  const msgs = [];
  if ($("system").value.trim()) msgs.push({ role: "system", content: $("system").value.trim() });
  return msgs.concat(conversation, [{ role: "user", content: userContent }]);
}
// The attached image (a vision-language model's input) as a data: URL, or null.
function attachedImage() {
  const file = $("image").files[0];
  if (!file) return Promise.resolve(null);
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error("cannot read the image file"));
    reader.readAsDataURL(file);
  });
}
function addMessage(role, text, imageUrl) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  if (imageUrl) {
    const img = document.createElement("img");
    img.src = imageUrl;
    img.className = "thumb";
    div.prepend(img);
  }
  $("transcript").appendChild(div);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return div;
}
async function errorText(r) {
  try { return (await r.json()).error.message; } catch (e) { return `HTTP ${r.status}`; }
}
async function send(text, imageUrl) {
  const content = imageUrl ? [{ type: "image_url", image_url: { url: imageUrl } }, { type: "text", text }] : text;
  const messages = messagesWith(content);
  const userDiv = addMessage("user", text, imageUrl);
  const div = addMessage("assistant", "");
  div.dataset.chunks = "0";
  const t0 = performance.now();
  let reply = "", ttft = null, usage = null, finish = null;
  const epoch = chatEpoch, controller = new AbortController();
  if (replying) replying.abort();  // (one reply at a time: a new message stops the last)
  replying = controller;
  $("stop").disabled = false;
  try {
    if (!modelName) await loadModelName();
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }), signal: controller.signal,
      body: JSON.stringify(Object.assign(samplingBody(), { messages, stream: true,
        stream_options: { include_usage: true } })),
    });
    if (r.status === 401) { userDiv.remove(); div.remove(); await needKey(); return send(text, imageUrl); }
    if (!r.ok) throw new Error(await errorText(r));
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        if (ttft === null) ttft = (performance.now() - t0) / 1000;
        reply += choice.delta.content;
        div.firstChild ? (div.firstChild.textContent = reply) : (div.textContent = reply);
        div.dataset.chunks = String(+div.dataset.chunks + 1);
        $("transcript").scrollTop = $("transcript").scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    const total = (performance.now() - t0) / 1000;
    const meta = document.createElement("span");
    meta.className = "meta";
    const n = usage ? usage.completion_tokens : null;
    meta.textContent = (usage ? `${usage.prompt_tokens} prompt + ${n} completion tokens · ` : "") +
      `first token ${ttft === null ? "–" : ttft.toFixed(2) + " s"} · total ${total.toFixed(2)} s` +
      (n && ttft !== null && total > ttft ? ` · ${((n - 1) / (total - ttft)).toFixed(1)} tok/s` : "") +
      ` · finish ${finish}`;
    div.appendChild(meta);
    if (epoch === chatEpoch) conversation.push({ role: "user", content }, { role: "assistant", content: reply });
  } catch (e) {
    if (e.name !== "AbortError") {
      div.className = "msg error";
      div.textContent = "Error: " + e.message;
    } else if (epoch === chatEpoch) {  // stopped: the reply so far stays, and the next message reads it
      const meta = document.createElement("span");
      meta.className = "meta";
      meta.textContent = "stopped";
      div.appendChild(meta);
      conversation.push({ role: "user", content }, { role: "assistant", content: reply });
    }
  }
  if (replying === controller) { replying = null; $("stop").disabled = true; }
  div.dataset.done = "1";
}
// N copies as one request of n = N: its sequences run together, sharing the prompt's
// blocks.  (N requests of their own ran five at a time: a browser opens six connections
// to a host, and the event stream holds one.)
async function sendCopies(text, n) {
  const out = $("copies-result");
  out.textContent = `sending ${n} copies…`;
  delete out.dataset.done;
  if (!modelName) await loadModelName();
  const body = JSON.stringify(Object.assign(samplingBody(), { messages: messagesWith(text), n }));
  const t0 = performance.now();
  let result;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", body,
                                                     headers: authHeaders({ "Content-Type": "application/json" }) });
    result = r.ok ? await r.json() : { error: await errorText(r) };
  } catch (e) { result = { error: e.message }; }
  const secs = (performance.now() - t0) / 1000;
  const choices = result.error ? [] : result.choices;
  const tokens = result.error ? 0 : result.usage.completion_tokens;
  const distinct = new Set(choices.map((c) => c.message.content)).size;
  out.textContent = `${choices.length}/${n} copies answered in ${secs.toFixed(2)} s: ${tokens} tokens ` +
    `(${(tokens / secs).toFixed(1)} tok/s together), ${distinct} distinct replies` +
    (result.error ? `\nerror: ${result.error}` : "");
  out.dataset.done = "1";
}
$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("message").value.trim();
  if (!text) return;
  $("message").value = "";
  attachedImage().then((url) => { $("image").value = ""; send(text, url); },
    (err) => addMessage("error", "Error: " + err.message));
});
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
});
$("send-copies").addEventListener("click", () => {
  const text = $("message").value.trim() || "Write a haiku about paged memory.";
  sendCopies(text, Math.max(1, Math.min(256, +$("copies").value || 1)));
});
$("stop").addEventListener("click", () => { if (replying) replying.abort(); });
$("clear").addEventListener("click", () => {
  chatEpoch += 1;  // (a reply still streaming is stopped and never joins the new chat)
  if (replying) replying.abort();
  conversation.length = 0;
  $("transcript").replaceChildren();
});
window.addEventListener("resize", () => { layoutPool(); drawCharts(); });

watch();

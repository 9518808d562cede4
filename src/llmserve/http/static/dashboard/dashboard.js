// llmserve dashboard: polls dashboard/state once a second and draws tiles, small SVG time-series charts
// (the last HISTORY polls, kept in the page) and, for a router, a table per pool and per backend.
// Plain JS, no dependencies. When the state answers 401 the page asks for the API key once (kept in
// sessionStorage for this tab) and sends it as `Authorization: Bearer`.
"use strict";

const HISTORY = 60;
const POLL_MS = 1000;
const COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f"];
const KEY_STORAGE = "llmserve-dashboard-key";
const SVG_NS = "http://www.w3.org/2000/svg";
const W = 300, H = 110, PAD_L = 44, PAD_B = 4, PAD_T = 6;

const view = {kind: null, charts: new Map(), tiles: new Map(), key: sessionStorage.getItem(KEY_STORAGE)};

// ---- formatting -------------------------------------------------------------------------------------

function num(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + "k";
  return Number.isInteger(v) ? String(v) : v.toFixed(digits);
}

// Below 1%, two significant digits: a chart's axis at low usage reads 0%, 0.050%, 0.10%, not 0.0%, 0.1%, 0.1%.
function pct(v) {
  if (v === null || v === undefined) return "–";
  const p = 100 * v;
  const digits = p === 0 || Math.abs(p) >= 1 ? 1 : Math.min(6, 1 - Math.floor(Math.log10(Math.abs(p))));
  return p.toFixed(digits) + "%";
}

function secs(v) {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  return v < 1 ? (1000 * v).toPrecision(3) + " ms" : v.toPrecision(3) + " s";
}

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

// ---- tiles ------------------------------------------------------------------------------------------

function tile(id, label) {
  if (!view.tiles.has(id)) {
    const node = el("div", {class: "tile", "data-field": id});
    node.append(el("div", {class: "label"}, label), el("div", {class: "value"}, "–"), el("div", {class: "sub"}));
    document.getElementById("tiles").append(node);
    view.tiles.set(id, node);
  }
  return view.tiles.get(id);
}

function setTile(id, label, value, sub = "", fraction = null) {
  const node = tile(id, label);
  node.querySelector(".value").textContent = value;
  node.querySelector(".sub").textContent = sub;
  node.dataset.value = value;
  if (fraction !== null) setBar(node, fraction);
}

function setBar(node, fraction) {
  let bar = node.querySelector(".bar > span");
  if (!bar) {
    const outer = el("div", {class: "bar"});
    bar = el("span");
    outer.append(bar);
    node.append(outer);
  }
  bar.style.width = (100 * Math.min(1, Math.max(0, fraction || 0))).toFixed(1) + "%";
}

// ---- charts -----------------------------------------------------------------------------------------

function chart(id, title, format) {
  if (!view.charts.has(id)) {
    const fig = el("figure", {class: "chart", "data-chart": id});
    const caption = el("figcaption");
    caption.append(el("span", {}, title), el("span", {class: "max"}));
    const plot = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title});
    fig.append(caption, plot, el("div", {class: "legend"}));
    document.getElementById("charts").append(fig);
    view.charts.set(id, {fig, plot, format, series: new Map()});
  }
  return view.charts.get(id);
}

// Append one point per series (null: no value this poll) and redraw.
function pushChart(id, title, format, points) {
  const c = chart(id, title, format);
  for (const [name, value] of Object.entries(points)) {
    if (!c.series.has(name)) c.series.set(name, []);
  }
  for (const [name, values] of c.series) {
    values.push(name in points ? points[name] : null);
    if (values.length > HISTORY) values.shift();
  }
  drawChart(c);
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 2.5, 5, 10].map(m => m * step).find(m => m >= v);
}

function drawChart(c) {
  const all = [...c.series.values()].flat().filter(v => v !== null);
  const top = niceMax(Math.max(0, ...all));
  const width = Math.round(c.plot.getBoundingClientRect().width) || W;  // drawn at its pixel size: no stretching
  c.plot.setAttribute("viewBox", `0 0 ${width} ${H}`);
  c.plot.replaceChildren(...axes(top, c.format, width));
  let i = 0;
  for (const [name, values] of c.series) {
    c.plot.append(svg("polyline", {points: linePoints(values, top, width), stroke: COLORS[i++ % COLORS.length],
                                   "data-series": name}));
  }
  c.fig.dataset.max = String(Math.max(0, ...all));
  c.fig.dataset.points = String(Math.max(0, ...[...c.series.values()].map(v => v.length)));
  c.fig.querySelector(".max").textContent = "max " + c.format(Math.max(0, ...all));
  drawLegend(c);
}

function axes(top, format, width) {
  const nodes = [];
  for (const frac of [0, 0.5, 1]) {
    const y = PAD_T + (1 - frac) * (H - PAD_T - PAD_B);
    nodes.push(svg("line", {class: "grid", x1: PAD_L, x2: width, y1: y, y2: y}));
    const label = svg("text", {class: "axis", x: PAD_L - 4, y: y + 3, "text-anchor": "end"});
    label.textContent = format(top * frac);
    nodes.push(label);
  }
  return nodes;
}

function linePoints(values, top, width) {
  const dx = (width - PAD_L) / (HISTORY - 1);
  const x0 = width - (values.length - 1) * dx;
  const out = [];
  values.forEach((v, i) => {
    if (v !== null) out.push(`${(x0 + i * dx).toFixed(1)},${(PAD_T + (1 - v / top) * (H - PAD_T - PAD_B)).toFixed(1)}`);
  });
  return out.join(" ");
}

function drawLegend(c) {
  const legend = c.fig.querySelector(".legend");
  legend.replaceChildren();
  let i = 0;
  for (const [name, values] of c.series) {
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = COLORS[i++ % COLORS.length];
    item.append(swatch, `${name} ${c.format(values[values.length - 1])}`);
    legend.append(item);
  }
}

// ---- the server -------------------------------------------------------------------------------------

function renderServer(s) {
  const r = s.requests, kv = s.kv_cache, lat = s.latency;
  setTile("running", "Requests running", num(r.running), `${num(r.in_flight)} in flight`);
  setTile("waiting", "Requests waiting", num(r.waiting), `${num(r.finished_per_s)} finished/s`);
  setTile("kv", "KV blocks used", `${num(kv.used_blocks)} / ${num(kv.blocks)}`, `${num(kv.free_blocks)} free`,
          kv.usage);
  setTile("prefix", "Prefix-cache hit rate", pct(kv.prefix_hit_rate), "prompt tokens, last minute");
  setTile("tokens", "Output tokens/s", num(s.throughput.output_tokens_per_s),
          `prompt ${num(s.throughput.prompt_tokens_per_s)}/s`);
  setTile("ttft", "TTFT p50 / p99", `${secs(lat.ttft.p50)}`, `p99 ${secs(lat.ttft.p99)}`);
  setTile("itl", "Inter-token p50 / p99", `${secs(lat.itl.p50)}`, `p99 ${secs(lat.itl.p99)}`);
  setTile("preemptions", "Preemptions", num(s.preemptions.total), `${num(s.preemptions.per_s)}/s`);
  setTile("spec", "Speculative acceptance", pct(s.speculative.acceptance_rate),
          s.speculative.draft_tokens ? `${num(s.speculative.draft_tokens)} draft tokens` : "no drafts");
  setTile("grammar", "Grammar-cache hit rate", pct(s.grammar_cache.hit_rate),
          `${num(s.grammar_cache.queries)} lookups`);
  if (s.moe) renderMoe(s.moe);
  if (s.kv_tiers) renderKvTiers(s.kv_tiers);
  if (s.lora) renderLora(s.lora);
  serverCharts(s);
}

// Mixture-of-Experts models only (the state's `moe` is null for a dense one): tokens per expert, max over mean.
function renderMoe(moe) {
  const b = moe.load_max_over_mean;
  setTile("moe", "Expert load max/mean p50", num(b.p50, 2), `p99 ${num(b.p99, 2)}, 1 = even`);
  pushChart("moe", "Expert load, max/mean (last minute)", v => num(v, 2), {p50: b.p50, p99: b.p99});
}

// Servers with KV tiers or a disaggregation role only (the state's `kv_tiers` is null otherwise).
function renderKvTiers(t) {
  setTile("kvtiers", "KV tier hits (tokens)", `${num(t.host_hit_tokens)} host / ${num(t.disk_hit_tokens)} disk`,
          `${num(t.offloaded_blocks)} blocks offloaded, ${num(t.corrupt_blocks)} corrupt`);
  if (t.sent_blocks || t.received_blocks) {
    const role = t.sent_blocks ? "prefill server" : "decode server";
    setTile("kvtransfer", "KV transfer", role, `${num(t.sent_blocks)} blocks sent, ${num(t.received_blocks)} received`);
  }
}

// Servers with --enable-lora only (the state's `lora` is null otherwise): adapters served, each one's traffic.
function renderLora(lora) {
  const busiest = [...lora.adapters].sort((a, b) => (b.output_tokens_per_s || 0) - (a.output_tokens_per_s || 0));
  const top = busiest.slice(0, 3).map(a => `${a.name} ${num(a.output_tokens_per_s)}/s`).join(", ");
  setTile("lora", "LoRA adapters", `${num(lora.served)} served`, top || "no adapter traffic yet");
  const points = {};
  for (const a of busiest.slice(0, 8)) points[a.name] = a.output_tokens_per_s;
  if (busiest.length) pushChart("lora", "Output tokens/s by adapter", num, points);
}

function serverCharts(s) {
  const lat = s.latency;
  pushChart("requests", "Requests", num, {running: s.requests.running, waiting: s.requests.waiting});
  pushChart("tokens", "Output tokens/s", num, {"tokens/s": s.throughput.output_tokens_per_s});
  pushChart("kv", "KV cache used", pct, {used: s.kv_cache.usage});
  pushChart("ttft", "Time to first token (last minute)", secs,
            {p50: lat.ttft.p50, p90: lat.ttft.p90, p99: lat.ttft.p99});
  pushChart("itl", "Inter-token latency (last minute)", secs,
            {p50: lat.itl.p50, p90: lat.itl.p90, p99: lat.itl.p99});
  pushChart("preemptions", "Preemptions/s", num, {"preemptions/s": s.preemptions.per_s});
}

// ---- the router -------------------------------------------------------------------------------------

function renderRouter(s) {
  const t = s.totals;
  setTile("requests_per_s", "Routed requests/s", num(t.requests_per_s), `${num(t.retries_per_s)} retries/s`);
  setTile("in_flight", "In flight", num(t.in_flight), `${num(t.queued)} queued in the gateway`);
  setTile("backends_up", "Backends up", `${t.backends_up} / ${t.backends}`, "",
          t.backends ? t.backends_up / t.backends : 0);
  setTile("rejected", "Rejected/s", num(t.rejected_per_s), "queue full, timeout, rate limit");
  setTile("duration", "Request duration p50", secs(t.duration.p50), `p99 ${secs(t.duration.p99)}`);
  pushChart("requests_per_s", "Routed requests/s by backend", num,
            Object.fromEntries(s.backends.map(b => [shortUrl(b.url), b.requests_per_s])));
  pushChart("in_flight", "In flight by backend", num,
            Object.fromEntries(s.backends.map(b => [shortUrl(b.url), b.in_flight])));
  pushChart("duration", "Request duration (last minute)", secs,
            {p50: t.duration.p50, p90: t.duration.p90, p99: t.duration.p99});
  renderTable("pools", "Model pools", POOL_COLUMNS, s.pools, p => p.name);
  renderTable("backends", "Replicas", BACKEND_COLUMNS, s.backends, b => b.url);
}

function shortUrl(url) {
  return url.replace(/^https?:\/\//, "");
}

function health(b) {
  const state = b.draining ? "draining" : b.health;
  return el("span", {class: `badge ${state}`}, state.replace("_", "-"));
}

function scaler(p) {
  const a = p.autoscaler;
  return a ? `${num(a.replicas)} (↑${num(a.scale_up)} ↓${num(a.scale_down)})` : "–";
}

const POOL_COLUMNS = [
  ["Pool", p => p.name], ["Policy", p => p.policy], ["Up", p => `${p.backends_up} / ${p.backends}`],
  ["Queued", p => num(p.queued)], ["In flight", p => num(p.in_flight)], ["Requests/s", p => num(p.requests_per_s)],
  ["p50", p => secs(p.duration.p50)], ["p99", p => secs(p.duration.p99)], ["Autoscaler replicas (↑ ↓)", scaler],
];

function adapters(b) {
  return b.adapters.length ? `${b.adapters.length} (${b.resident_adapters.length})` : "–";
}

const BACKEND_COLUMNS = [
  ["Replica", b => shortUrl(b.url)], ["Pool", b => b.pool], ["Health", health], ["In flight", b => num(b.in_flight)],
  ["Running", b => num(b.running)], ["Waiting", b => num(b.waiting)], ["KV used", b => pct(b.kv_usage)],
  ["Routed", b => num(b.routed)], ["Requests/s", b => num(b.requests_per_s)],
  ["Errors (1 min)", b => num(b.errors_in_window)], ["Ejections", b => num(b.ejections)],
  ["Upstream p50", b => secs(b.latency.p50)], ["LoRA adapters (in slots)", adapters],
];

function renderTable(id, title, columns, rows, keyOf) {
  let table = document.getElementById(id);
  if (!table) {
    table = el("table", {id});
    const head = el("tr");
    for (const [name] of columns) head.append(el("th", {}, name));
    table.append(el("thead"), el("tbody"));
    table.tHead.append(head);
    document.getElementById("tables").append(el("h2", {}, title), table);
  }
  table.tBodies[0].replaceChildren(...rows.map(row => tableRow(columns, row, keyOf(row))));
}

function tableRow(columns, row, key) {
  const tr = el("tr", {"data-key": key});
  for (const [name, cell] of columns) {
    const value = cell(row);
    const td = el("td", {"data-column": name});
    if (value instanceof Node) td.append(value); else td.textContent = value;
    tr.append(td);
  }
  return tr;
}

// ---- polling ----------------------------------------------------------------------------------------

function setStatus(state, text) {
  const node = document.getElementById("status");
  node.dataset.state = state;
  node.textContent = text;
}

function render(s) {
  if (view.kind !== s.kind) {
    view.kind = s.kind;
    document.getElementById("kind").textContent = s.kind === "router" ? "router dashboard" : "dashboard";
  }
  document.getElementById("model").textContent = s.kind === "router" ? s.models.join(", ") : s.model;
  document.getElementById("window").textContent = `${Math.round(s.window_s)} s`;
  if (s.kind === "router") renderRouter(s); else renderServer(s);
  setStatus("live", "live · " + new Date(s.time * 1000).toLocaleTimeString());
}

function askForKey() {
  const form = document.getElementById("key-form");
  form.hidden = false;
  setStatus("error", "needs the API key");
  form.onsubmit = event => {
    event.preventDefault();
    view.key = document.getElementById("key-input").value.trim();
    sessionStorage.setItem(KEY_STORAGE, view.key);
    form.hidden = true;
    poll();
  };
}

async function poll() {
  const headers = view.key ? {Authorization: `Bearer ${view.key}`} : {};
  try {
    const response = await fetch("dashboard/state", {headers, cache: "no-store"});
    if (response.status === 401) {
      askForKey();
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (error) {
    setStatus("error", `no answer (${error.message}); retrying`);
  }
  setTimeout(poll, POLL_MS);
}

poll();

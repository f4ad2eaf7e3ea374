// The dashboard (GET /dashboard): this server's state, live, from its own /metrics (Prometheus text,
// parsed here) polled every second; on the PD router also GET router/instances (each instance's
// role, health and load). Cards show the values now, charts the last five minutes.
import { $, ApiError, api, apiKey, errorText, keyButton, vendor } from "./common.js";

const KIND = document.body.dataset.kind; // "server" or "router"
const POLL_MS = 1000;
const SPAN_S = 300; // what the charts show
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
const history = []; // {t: Unix seconds, m: metrics, instances: router/instances answer}
let uPlot = null;
let charts = [];
let prefix = "splitserve"; // --metrics-prefix: splitserve:* by default, vllm:* as vLLM names them

// --- Prometheus text ------------------------------------------------------------------------------
/** name -> [{labels, value}] of every sample in an exposition text. */
export function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    const match = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!match) continue; // comments, blank lines
    const labels = {};
    for (const [, k, v] of (match[2] ?? "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
    const value = { "+Inf": Infinity, "-Inf": -Infinity }[match[3]] ?? Number(match[3]);
    if (!out.has(match[1])) out.set(match[1], []);
    out.get(match[1]).push({ labels, value });
  }
  return out;
}

const sum = (m, name) => (m?.get(name) ?? []).reduce((total, s) => total + s.value, 0);

/** A histogram's cumulative buckets [[le, count]], summed over its label sets. */
function buckets(m, name) {
  const counts = new Map();
  for (const s of m?.get(`${name}_bucket`) ?? []) counts.set(s.labels.le, (counts.get(s.labels.le) ?? 0) + s.value);
  return [...counts].map(([le, c]) => [le === "+Inf" ? Infinity : Number(le), c]).sort((a, b) => a[0] - b[0]);
}

/** Prometheus's histogram_quantile over the observations between two scrapes (`before` null: all). */
export function quantile(q, now, before) {
  const counts = now.map(([le, c], i) => [le, c - (before?.[i]?.[1] ?? 0)]);
  const total = counts.at(-1)?.[1] ?? 0;
  if (!(total > 0)) return null;
  let [lower, below] = [0, 0];
  for (const [le, c] of counts) {
    if (c >= q * total) return le === Infinity ? lower : lower + ((le - lower) * (q * total - below)) / (c - below || 1);
    [lower, below] = [le, c];
  }
  return null;
}

// --- over time ------------------------------------------------------------------------------------
const latest = () => history.at(-1);
/** The scrape about `seconds` before the latest (the oldest one kept, if none is that old). */
const ago = (seconds) => history.find((h) => h.t >= latest().t - seconds - 0.5) ?? history[0];

function rate(name, seconds = 5) {
  const [now, then] = [latest(), ago(seconds)];
  return now === then ? null : Math.max(sum(now.m, name) - sum(then.m, name), 0) / (now.t - then.t);
}

/** The q-quantile of a histogram's observations of the last `seconds`; with none, of all of them if `all`. */
function windowQuantile(q, name, seconds, all = false) {
  const now = buckets(latest().m, name);
  const recent = quantile(q, now, buckets(ago(seconds).m, name));
  return recent ?? (all ? quantile(q, now, null) : null);
}

/** hits / queries of the last `seconds` (of all time, with none), or null. */
function ratio(num, den, seconds) {
  const [now, then] = [latest(), ago(seconds)];
  const d = sum(now.m, den) - sum(then.m, den);
  if (d > 0) return (sum(now.m, num) - sum(then.m, num)) / d;
  return sum(now.m, den) > 0 ? sum(now.m, num) / sum(now.m, den) : null;
}

// --- what is shown --------------------------------------------------------------------------------
const P = (name) => `${prefix}:${name}`;
const R = (name) => `splitserve_router:${name}`;
const num = (x, digits = 1) => (x == null || Number.isNaN(x) ? "—" : x.toFixed(digits));
const pct = (x) => (x == null || Number.isNaN(x) ? "—" : `${(100 * x).toFixed(1)} %`);
const secs = (x) => (x == null ? "—" : x < 1 ? `${Math.round(x * 1000)} ms` : `${x.toFixed(2)} s`);
const percentiles = (name) => [0.5, 0.9, 0.99].map((q) => secs(windowQuantile(q, name, 60, true))).join(" / ");
const instances = () => latest().instances?.instances ?? [];

const SERVER_CARDS = [
  ["running", "Running requests", () => num(sum(latest().m, P("num_requests_running")), 0)],
  ["waiting", "Waiting requests", () => num(sum(latest().m, P("num_requests_waiting")), 0)],
  ["tokens_per_s", "Output tokens/s", () => num(rate(P("generation_tokens_total")))],
  ["ttft", "TTFT p50 / p90 / p99", () => percentiles(P("time_to_first_token_seconds"))],
  ["itl", "Inter-token p50 / p90 / p99", () => percentiles(P("inter_token_latency_seconds"))],
  ["kv_cache", "KV cache in use", () => pct(sum(latest().m, P("kv_cache_usage_perc")))],
  ["prefix_hits", "Prefix-cache hits", () => pct(ratio(P("prefix_cache_hits_total"), P("prefix_cache_queries_total"), 60))],
  ["preemptions", "Preemptions", () => num(sum(latest().m, P("num_preemptions_total")), 0)],
  ["spec_accept", "Speculative acceptance", () => pct(ratio(P("spec_decode_num_accepted_tokens_total"), P("spec_decode_num_draft_tokens_total"), 60))],
  ["finished", "Requests finished", () => num(sum(latest().m, P("request_success_total")), 0)],
  ["restarts", "Engine restarts", () => num(sum(latest().m, P("engine_restarts_total")), 0)],
];
const SERVER_CHARTS = [
  ["Requests", ["running", "waiting"], () => [P("num_requests_running"), P("num_requests_waiting")].map((n) => sum(latest().m, n))],
  ["Tokens/s", ["output", "prompt"], () => [rate(P("generation_tokens_total")), rate(P("prompt_tokens_total"))]],
  ["Time to first token (s)", ["p50", "p90"], () => [0.5, 0.9].map((q) => windowQuantile(q, P("time_to_first_token_seconds"), 30))],
  ["Inter-token latency (s)", ["p50", "p90"], () => [0.5, 0.9].map((q) => windowQuantile(q, P("inter_token_latency_seconds"), 30))],
  ["KV cache (%)", ["in use", "prefix hits"], () => [sum(latest().m, P("kv_cache_usage_perc")), ratio(P("prefix_cache_hits_total"), P("prefix_cache_queries_total"), 30)].map((x) => (x == null ? null : 100 * x))],
];
const ROUTER_CARDS = [
  ["instances_up", "Instances up", () => `${instances().filter((i) => i.healthy).length} / ${instances().length}`],
  ["in_flight", "Requests in flight", () => num(instances().reduce((n, i) => n + i.in_flight, 0), 0)],
  ["requests_per_s", "Requests/s to instances", () => num(rate(R("requests_total")))],
  ["latency", "Latency p50 / p90 / p99", () => percentiles(R("request_latency_seconds"))],
  ["retries", "Retries", () => num(sum(latest().m, R("retries_total")), 0)],
  ["failures", "Failures", () => num(sum(latest().m, R("failures_total")), 0)],
  ["fallbacks", "Fallbacks (no remote prefill)", () => num(sum(latest().m, R("fallbacks_total")), 0)],
];
const ROUTER_CHARTS = [
  ["Requests/s", ["to instances", "failures"], () => [rate(R("requests_total")), rate(R("failures_total"))]],
  ["Latency (s)", ["p50", "p90"], () => [0.5, 0.9].map((q) => windowQuantile(q, R("request_latency_seconds"), 30))],
  ["In flight, per instance", null, () => instances().map((i) => i.in_flight)],
  ["Running + waiting, per instance", null, () => instances().map((i) => i.num_requests)],
];

// --- rendering ------------------------------------------------------------------------------------
function renderCards(cards) {
  const box = $("cards");
  if (!box.children.length) {
    for (const [id, label] of cards) {
      const card = Object.assign(document.createElement("div"), { className: "card" });
      card.dataset.metric = id;
      card.innerHTML = `<span class="label"></span><span class="value">—</span>`;
      card.firstChild.textContent = label;
      box.append(card);
    }
  }
  cards.forEach(([, , value], i) => {
    box.children[i].lastChild.textContent = value();
  });
}

/** An instance's KV bytes moved per second (served plus pulled) over the last 10 s of polls. */
function kvTransferRate(url) {
  const bytes = (h) => h.instances?.instances?.find((i) => i.url === url)?.kv_transfer_bytes;
  const then = ago(10);
  const [now, before] = [bytes(latest()), bytes(then)];
  return now == null || before == null || latest().t <= then.t ? null : (now - before) / (latest().t - then.t);
}

function renderInstances() {
  $("instances").hidden = false;
  const rows = instances().map((i) => {
    const tr = document.createElement("tr");
    const health = i.healthy ? "up" : `down: ${i.down_reason ?? "?"}`;
    const moved = kvTransferRate(i.url);
    const kv = moved == null ? "—" : `${num(moved / 1e6, 1)} MB/s`;
    for (const text of [i.url, i.role, health, i.in_flight, num(i.num_requests, 0), pct(i.kv_cache_usage), kv]) {
      tr.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    tr.className = i.healthy ? "up" : "down";
    return tr;
  });
  $("instances").querySelector("tbody").replaceChildren(...rows);
}

/** Gauges or counters named like *expert*load* (MoE models), as bars per label set; hidden without any. */
function renderExperts() {
  const names = [...latest().m.keys()].filter((n) => /expert.*load|load.*expert/i.test(n) && !/_(created|bucket)$/.test(n));
  $("experts").hidden = names.length === 0;
  const samples = names.flatMap((n) => latest().m.get(n));
  const max = Math.max(...samples.map((s) => s.value), 1e-9);
  $("experts").querySelector(".bars").replaceChildren(
    ...samples.map((s) => {
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.title = `${JSON.stringify(s.labels)}: ${s.value}`;
      bar.style.height = `${Math.max(2, (100 * s.value) / max)}%`;
      return bar;
    }),
  );
}

function makeChart([title, series, values]) {
  const figure = document.createElement("figure");
  figure.className = "chart";
  figure.append(Object.assign(document.createElement("figcaption"), { textContent: title }));
  $("charts").append(figure);
  const labels = series ?? instances().map((i) => `${i.role} ${i.url.replace(/^https?:\/\//, "")}`);
  const data = [[], ...labels.map(() => [])];
  const options = {
    width: figure.clientWidth || 400,
    height: 170,
    series: [{}, ...labels.map((label, i) => ({ label, stroke: COLORS[i % COLORS.length], width: 2 }))],
    axes: [{}, { size: 56 }],
    legend: { live: false },
    scales: {
      x: { time: true, range: (u, min, max) => [max - SPAN_S, max] }, // the last minutes, new values on the right
      y: { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] },
    },
  };
  return { figure, data, values, plot: new uPlot(options, data, figure) };
}

function renderCharts(defs) {
  if (!uPlot) return;
  if (!charts.length) charts = defs.map(makeChart);
  const t = latest().t;
  for (const chart of charts) {
    const values = chart.values();
    chart.data.forEach((column, i) => column.push(i === 0 ? t : values[i - 1] ?? null));
    while (chart.data[0][0] < t - SPAN_S) chart.data.forEach((column) => column.shift());
    if (chart.data[0].length > 1) chart.plot.setData(chart.data); // one point has no time span to draw
  }
}

function render() {
  if (KIND === "router") {
    renderCards(ROUTER_CARDS);
    renderInstances();
    renderCharts(ROUTER_CHARTS);
  } else {
    renderCards(SERVER_CARDS);
    renderExperts();
    renderRecent();
    renderCharts(SERVER_CHARTS);
  }
}

// --- polling --------------------------------------------------------------------------------------
async function fetchOk(path) {
  const response = await api(path);
  if (!response.ok) throw new ApiError(response.status, `${path}: ${await errorText(response)}`);
  return response;
}

let timer = null;
let recentRequests = []; // GET recent_requests: this API process's last finished requests

const ms = (s) => (s == null ? "—" : `${Math.round(1000 * s)} ms`);

/** GET recent_requests, with the API key when one is known. It is behind the key where /metrics may be
 * open: without a key the table stays hidden and nothing asks for one (the rest of the page works). */
async function recentOrNull() {
  const key = apiKey();
  const response = await fetch("recent_requests", key ? { headers: { Authorization: `Bearer ${key}` } } : {});
  return response.ok ? (await response.json()).data : null;
}

/** The last finished requests with their timings, most recent first. */
function renderRecent() {
  $("recent").hidden = recentRequests.length === 0;
  const rows = recentRequests.map((r) => {
    const tr = document.createElement("tr");
    const when = new Date(r.finished_at * 1000).toLocaleTimeString();
    const cells = [r.request_id, when, r.finish_reason ?? "—", r.prompt_tokens, r.cached_tokens, r.generated_tokens];
    for (const text of [...cells, ms(r.queue_s), ms(r.ttft_s), ms(r.e2e_s), num(r.tokens_per_s)]) {
      tr.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    return tr;
  });
  $("recent").querySelector("tbody").replaceChildren(...rows);
}

async function poll() {
  clearTimeout(timer);
  try {
    const [text, routerInstances, recent] = await Promise.all([
      fetchOk("metrics").then((r) => r.text()),
      KIND === "router" ? fetchOk("router/instances").then((r) => r.json()) : null,
      KIND === "router" ? null : recentOrNull(),
    ]);
    recentRequests = recent ?? [];
    const m = parseMetrics(text);
    const name = [...m.keys()].find((n) => /^\w+:(num_requests_running|generation_tokens_total)$/.test(n));
    if (name) prefix = name.split(":")[0];
    history.push({ t: Date.now() / 1000, m, instances: routerInstances });
    while (history[0].t < latest().t - SPAN_S) history.shift();
    render();
    $("status").textContent = `live · ${new Date().toLocaleTimeString()}`;
    $("status").className = "status ok";
  } catch (err) {
    $("status").textContent = `not updated: ${err.message}`;
    $("status").className = "status error";
    if (err.status === 401) return; // until a key is given (the header's button)
  }
  timer = setTimeout(poll, POLL_MS);
}

async function start() {
  $("kind").textContent = KIND === "router" ? "router dashboard" : "dashboard";
  keyButton(poll);
  window.addEventListener("resize", () => {
    for (const c of charts) c.plot.setSize({ width: c.figure.clientWidth, height: 170 });
  });
  const loaded = vendor("uplot.js", "No charts (the numbers still update live)");
  poll();
  uPlot = (await loaded)?.default ?? null;
  if (!uPlot) return;
  const css = Object.assign(document.createElement("link"), { rel: "stylesheet", href: new URL("./vendor/uplot.css", import.meta.url) });
  document.head.append(css);
}

start();

// The Thermostat console: polls GET /v1/console/state and draws what it says. No build step, no
// framework; uPlot (vendored beside this file) draws the plots, console_requests.js the list of
// recent requests. See thermostat/api/console.py.
"use strict";

const KEY = "thermostat.apiKey";  // sessionStorage: this tab only
const THEME = "thermostat.theme";
const REFRESH_MS = 2000;
const PALETTE = ["#2f6fdb", "#d1495b", "#edae49", "#00798c", "#8e5cc4", "#66a182", "#e07a5f"];

const $ = (id) => document.getElementById(id);
const state = { instance: null, after: 0, rows: [], plots: {}, plotKeys: {}, timer: null, last: null };

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  const { dataset, ...rest } = props;
  Object.assign(node, rest);
  Object.assign(node.dataset, dataset || {});
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function show(value) {
  if (value === null || value === undefined) return "-";
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function clock(unix) {
  return new Date(unix * 1000).toLocaleTimeString([], { hour12: false });
}

// --- the API key and requests ------------------------------------------------------------------

async function api(path, options = {}) {
  const key = sessionStorage.getItem(KEY);
  const headers = Object.assign({}, options.headers || {});
  if (key) headers.Authorization = "Bearer " + key;
  return fetch(path, Object.assign({}, options, { headers }));
}

function askForKey(message) {
  $("main").hidden = true;
  $("key-panel").hidden = false;
  $("key-error").textContent = message || "";
  setStatus("waiting for the API key");
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key-input").value);
  $("key-input").value = "";
  refresh();
});

function setStatus(text, cls = "") {
  const node = $("status");
  node.textContent = text;
  node.className = cls;
}

// --- one refresh -------------------------------------------------------------------------------

async function refresh() {
  clearTimeout(state.timer);
  state.timer = setTimeout(refresh, REFRESH_MS);
  let response;
  try {
    response = await api("/v1/console/state?after=" + state.after +
      "&instance=" + encodeURIComponent(state.instance || ""));
  } catch (err) {
    setStatus("the server does not answer (" + err.message + ")", "bad");
    return;
  }
  if (response.status === 401) {
    clearTimeout(state.timer);  // nothing to poll until a key is given
    const refused = sessionStorage.getItem(KEY) !== null;
    sessionStorage.removeItem(KEY);
    askForKey(refused ? "That key was refused (401). Try again." : "");
    return;
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    setStatus("server answered " + response.status + ": " + ((body.error || {}).message || ""), "warn");
    return;
  }
  const data = await response.json();
  $("key-panel").hidden = true;
  $("main").hidden = false;
  state.last = data;
  setStatus("status: " + data.status + " · updated " + clock(data.now));
  renderFacts(data.facts);
  renderDefaults(data.defaults);
  renderCheck(data.check);
  renderDiagnose(data.diagnose);
  renderTraffic(data.series);
  if (data.facts.server === "thermostat gateway") {
    $("kv-caption").textContent = "KV cache usage: none here (a gateway has no engine; the upstream's metrics have it)";
  }
  takeRows(data);
  $("text-kept").textContent = data.keeps_text
    ? "(output text kept: --console-keep-text)"
    : "(output text not kept; --console-keep-text keeps it)";
}

// --- the server and its defaults ---------------------------------------------------------------

function renderFacts(facts) {
  const body = $("facts").tBodies[0];
  body.replaceChildren(...Object.entries(facts).map(([name, value]) => {
    let shown = value;
    if (name === "last handoff" && value) {
      shown = value.outcome === "agreed"
        ? "agreed with " + value.prefill + " at " + clock(value.time)
        : "REFUSED (" + value.outcome + ") at " + clock(value.time) + ": " + value.message;
    } else if (Array.isArray(value)) {
      shown = value.join("; ") || "-";
    }
    return el("tr", {}, el("th", {}, name), el("td", {}, show(shown)));
  }));
}

// As the startup table says it: an unset max_tokens is the room the prompt leaves in the context.
function effectiveDefault(name, value) {
  return name === "max_tokens" && value === null ? "prompt's room" : show(value);
}

function renderDefaults(d) {
  const gen = (d.generation_config || {}).values || {};
  const rec = (d.recommended || {}).values || {};
  $("defaults-table").tBodies[0].replaceChildren(...Object.keys(d.effective).map((name) =>
    el("tr", { dataset: { param: name } },
      el("td", {}, name),
      el("td", { className: "value" }, effectiveDefault(name, d.effective[name])),
      el("td", { className: "source" }, show(d.source[name])),
      el("td", {}, show(gen[name])),
      el("td", {}, show(rec[name])))));
  const policy = d.policy || {};
  $("policy").textContent = "policies: minimum temperature " + show(policy.min_temperature) +
    ", greedy " + show(policy.greedy) +
    (d.recommended ? " · family " + d.recommended.family +
      (d.recommended.applied ? " (recommended values applied)" : " (recommended values not applied)") : "") +
    (d.upstream ? " · upstream " + d.upstream.kind : "");
  $("warnings").replaceChildren(...(d.warnings || []).map((w) => el("li", {}, w)));
}

// --- check now and diagnose --------------------------------------------------------------------

$("check-now").addEventListener("click", async () => {
  const button = $("check-now");
  button.disabled = true;
  $("check-result").replaceChildren(el("p", {}, "running the checks…"));
  try {
    const response = await api("/v1/console/check", { method: "POST" });
    const body = await response.json();
    if (response.ok) renderCheck(body);
    else $("check-result").replaceChildren(el("p", { className: "bad" },
      "check refused (" + response.status + "): " + ((body.error || {}).message || "")));
  } catch (err) {
    $("check-result").replaceChildren(el("p", { className: "bad" }, "check failed: " + err.message));
  } finally {
    button.disabled = false;
  }
});

function renderCheck(check) {
  if (!check || $("check-now").disabled) return;
  const verdict = el("p", { className: "verdict " + (check.healthy ? "good" : "bad") },
    (check.healthy ? "PASS: healthy" : "FAIL: unhealthy") +
    " (ran " + clock(check.time) + ", " + check.seconds + " s)");
  verdict.dataset.verdict = check.healthy ? "pass" : "fail";
  const cls = { pass: "good", fail: "bad", warn: "warn", info: "" };
  const table = el("table", { className: "check-table" },
    el("thead", {}, el("tr", {}, el("th", {}, "check"), el("th", {}, "result"), el("th", {}, "detail"))),
    el("tbody", {}, ...check.checks.map((c) => el("tr", {},
      el("td", {}, c.name), el("td", { className: cls[c.status] || "" }, c.status.toUpperCase()),
      el("td", {}, c.detail)))));
  $("check-result").replaceChildren(verdict, table);
}

function renderDiagnose(diag) {
  if (!diag) {
    $("diagnose-result").replaceChildren(el("p", { className: "src" },
      "No diagnose result yet: `thermostat diagnose --url URL` shows its result here."));
    return;
  }
  const rows = diag.cells.map((c) => el("tr", {},
    el("td", {}, c.decoding), el("td", {}, c.kv_cache), el("td", {}, c.weights),
    el("td", {}, c.degenerate + "/" + c.generations), el("td", {}, c.example || "")));
  $("diagnose-result").replaceChildren(
    el("h3", {}, "Last diagnose (" + clock(diag.time) + ")"),
    el("p", {}, el("b", {}, "cause: " + diag.cause), " — " + (diag.explanation || "")),
    el("table", {}, el("thead", {}, el("tr", {}, ...["decoding", "KV cache", "weights",
      "degenerate", "example reason"].map((h) => el("th", {}, h)))), el("tbody", {}, ...rows)));
}

// --- traffic plots -----------------------------------------------------------------------------

function themeColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function plot(id, names, data, opts = {}) {
  const key = names.join("|");
  const container = $(id);
  if (state.plots[id] && state.plotKeys[id] === key) {
    state.plots[id].setData(data);
    return;
  }
  if (state.plots[id]) state.plots[id].destroy();
  const axis = { stroke: themeColor("--muted"), grid: { stroke: themeColor("--line"), width: 1 },
    ticks: { stroke: themeColor("--line"), width: 1 } };
  const series = [{}].concat(names.map((name, i) => ({
    label: name, stroke: PALETTE[i % PALETTE.length], fill: PALETTE[i % PALETTE.length] + "30",
    width: 1.5,
    spanGaps: false,
    points: opts.points ? { show: true, size: 5 } : {},
    value: (u, v) => (v === null || v === undefined ? "-" : +v.toFixed(3)),
  })));
  state.plots[id] = new uPlot({
    width: Math.max(300, container.clientWidth), height: 180, series,
    axes: [axis, Object.assign({ size: 50 }, axis)],
    scales: { y: opts.range ? { range: opts.range } : { range: (u, min, max) => [0, Math.max(1e-9, max) * 1.1] } },
    legend: { live: true },
  }, data, container);
  state.plotKeys[id] = key;
}

function windowed(s) {
  // the last `#window` seconds of every series (the server sends the hour)
  const keep = Math.round(+$("window").value / s.bucket_s);
  const cut = (a) => a.slice(-keep);
  const each = (o) => Object.fromEntries(Object.entries(o).map(([k, v]) => [k, cut(v)]));
  return Object.assign({}, s, {
    time: cut(s.time), requests_per_min: each(s.requests_per_min), greedy_share: cut(s.greedy_share),
    degenerate_per_min: each(s.degenerate_per_min), tokens_per_s: cut(s.tokens_per_s),
    ttft_p50_s: cut(s.ttft_p50_s), ttft_p95_s: cut(s.ttft_p95_s), kv_usage: cut(s.kv_usage),
  });
}

function renderTraffic(all) {
  const s = windowed(all);
  const t = s.time;
  const totals = s.totals;
  const share = totals.requests ? (100 * totals.greedy / totals.requests).toFixed(0) + "%" : "-";
  $("totals").replaceChildren(
    ...[["requests", totals.requests], ["greedy", totals.greedy + " (" + share + ")"],
      ["degenerate responses", totals.degenerate], ["tokens generated", totals.tokens]]
      .map(([name, value]) => el("div", { dataset: { total: name.split(" ")[0] } },
        el("b", {}, show(value)), name)));
  const bySource = Object.keys(s.requests_per_min);
  plot("plot-requests", bySource.length ? bySource : ["none yet"],
    [t].concat(bySource.length ? bySource.map((k) => s.requests_per_min[k]) : [t.map(() => 0)]));
  // ratios, percentiles and samples are null where there is no data: points show lone values
  plot("plot-greedy", ["greedy share"], [t, s.greedy_share], { range: [0, 1], points: true });
  const detectors = Object.keys(s.degenerate_per_min);
  plot("plot-degenerate", detectors.length ? detectors : ["none yet"],
    [t].concat(detectors.length ? detectors.map((k) => s.degenerate_per_min[k]) : [t.map(() => 0)]));
  plot("plot-tokens", ["tokens/s"], [t, s.tokens_per_s]);
  plot("plot-ttft", ["p50", "p95"], [t, s.ttft_p50_s, s.ttft_p95_s], { points: true });
  plot("plot-kv", ["KV usage"], [t, s.kv_usage], { range: [0, 1], points: true });
}

$("window").addEventListener("change", redrawPlots);

function redrawPlots() {
  for (const id of Object.keys(state.plots)) state.plots[id].destroy();
  state.plots = {};
  state.plotKeys = {};
  if (state.last) renderTraffic(state.last.series);
}

// --- recent requests (console_requests.js) ----------------------------------------------------

$("only-degenerate").addEventListener("change", renderRows);
$("only-greedy").addEventListener("change", renderRows);

// --- theme -------------------------------------------------------------------------------------

function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  redrawPlots();
}

$("theme").addEventListener("click", () => {
  const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
  localStorage.setItem(THEME, next);
  applyTheme(next);
});

applyTheme(localStorage.getItem(THEME) ||
  (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light"));
refresh();

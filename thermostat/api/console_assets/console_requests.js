// The Thermostat console's recent requests: the list, its filters and one request's detail.
// Loaded before console.js, which calls these; they use its state, $, el, show, clock and api.
"use strict";

const MAX_ROWS = 500;

// A page polls its server's ring: `after` counts in `instance`; a server started since (restarted,
// or another one on this port) counts from 1 again, and the list starts over with its rows.
function takeRows(data) {
  if (data.instance !== state.instance) {
    Object.assign(state, { instance: data.instance, after: 0, rows: [] });
    renderRows();
  }
  const rows = data.requests.filter((r) => r.id > state.after);  // overlapping polls repeat rows
  if (!rows.length) return;
  state.rows.push(...rows);
  state.after = rows[rows.length - 1].id;
  if (state.rows.length > MAX_ROWS) state.rows.splice(0, state.rows.length - MAX_ROWS);
  renderRows();
}

function sampled(entry) {
  return el("span", {}, show(entry.value), " ", el("span", { className: "src" }, show(entry.source)));
}

// The verdict comes second in a row, so that a narrow window shows it (the table scrolls).
function verdict(r) {
  if (r.degenerate) return el("td", { className: "bad reasons" }, "DEGENERATE: " + r.reasons.join("; "));
  if (r.error) return el("td", { className: "warn reasons" }, r.status.toUpperCase() + ": " + r.error);
  return el("td", { className: r.status === "ok" ? "good" : "warn" }, r.status);
}

function renderRows() {
  const onlyDegenerate = $("only-degenerate").checked;
  const onlyGreedy = $("only-greedy").checked;
  const shown = state.rows.filter((r) => (!onlyDegenerate || r.degenerate) && (!onlyGreedy || r.greedy));
  $("requests-count").textContent = "(" + shown.length + " shown of the last " + state.rows.length + ")";
  $("requests-table").tBodies[0].replaceChildren(...shown.slice().reverse().map((r) => {
    const row = el("tr", {},
      el("td", {}, clock(r.time)), verdict(r), el("td", {}, r.endpoint),
      el("td", { className: "client", title: r.client || "" }, show(r.client)),
      el("td", {}, sampled(r.sampling.temperature), r.greedy ? " (greedy)" : ""),
      el("td", {}, sampled(r.sampling.top_p)), el("td", {}, sampled(r.sampling.top_k)),
      el("td", {}, sampled(r.sampling.max_tokens)), el("td", {}, r.policies.join(", ") || "-"),
      el("td", {}, r.finish_reasons.map(show).join(", ") || "-"),
      el("td", {}, r.prompt_tokens + " → " + r.completion_tokens));
    row.dataset.id = r.id;
    row.dataset.degenerate = r.degenerate;
    row.dataset.greedy = r.greedy;
    row.addEventListener("click", () => openDetail(r.id));
    return row;
  }));
}

async function openDetail(id) {
  const response = await api("/v1/console/requests/" + id);
  const body = await response.json();
  if (!response.ok) {
    $("detail-title").textContent = "Request " + id + ": " + ((body.error || {}).message || response.status);
    $("detail-sampling").textContent = "";
    $("detail-quality").textContent = "";
  } else {
    $("detail-title").textContent = "Request " + id + " · " + body.endpoint + " · " + (body.request_id || "");
    $("detail-sampling").textContent = JSON.stringify(body.sampling, null, 2);
    $("detail-quality").textContent = JSON.stringify(body.quality, null, 2);
    $("detail-text-block").hidden = !body.text;
    $("detail-text").textContent = (body.text || []).join("\n---\n");
  }
  $("detail").showModal();
}

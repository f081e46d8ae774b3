// qworker's pool dashboard: polls the JSON under /dashboard/api (at most once a second) and draws
// it with DOM calls. Written for qworker; no library, no build step. Every value from the server
// goes in as text (textContent, setAttribute), never as HTML, so an id holding markup shows as text.
"use strict";

(function () {
  const API = "/dashboard/api";
  const state = {
    session: { role: "read", can_act: false, csrf_token: null, refresh_ms: 1000 },
    batchOffset: 0,
    batchLimit: 20,
    workerOffset: 0,
    workerLimit: 50,
    failedOffset: 0,
    failedLimit: 50,
    timer: null,
    generation: 0,
    sections: {},
  };

  // -- helpers ---------------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "onclick") node.addEventListener("click", value);
      else if (name === "style") node.style.cssText = value;
      else node.setAttribute(name, String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fmtNum(value, digits) {
    if (value === null || value === undefined) return "—";
    if (typeof value !== "number") return String(value);
    return digits === undefined ? value.toLocaleString("en-US") : value.toFixed(digits);
  }

  function fmtAge(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    if (seconds < 120) return seconds.toFixed(seconds < 10 ? 1 : 0) + " s";
    if (seconds < 7200) return (seconds / 60).toFixed(0) + " min";
    if (seconds < 172800) return (seconds / 3600).toFixed(1) + " h";
    return (seconds / 86400).toFixed(1) + " d";
  }

  function fmtTime(epoch) {
    if (!epoch) return "—";
    return new Date(epoch * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
  }

  function pct(part, whole) {
    return whole ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0;
  }

  function bar(parts, testid, label) {
    // parts: [[value, className], ...] of one whole
    const whole = parts.reduce((sum, p) => sum + (p[0] || 0), 0);
    return el(
      "div",
      { class: "bar", "data-testid": testid, title: label || "" },
      parts.map(([value, cls]) => el("span", { class: cls, style: "width:" + pct(value || 0, whole) + "%" })),
    );
  }

  async function api(path, options) {
    const response = await fetch(API + path, { credentials: "same-origin", cache: "no-store", ...(options || {}) });
    let body = null;
    try {
      body = await response.json();
    } catch (e) {
      body = null;
    }
    if (!response.ok) {
      const message = body && body.error ? body.error.message : response.statusText;
      const error = new Error(response.status + ": " + message);
      error.status = response.status;
      throw error;
    }
    return body;
  }

  function setStatus(text, ok) {
    const node = document.getElementById("status");
    node.textContent = text;
    node.className = ok ? "ok" : "bad";
  }

  function section(id, title, data, render) {
    // Redrawn only when its data changed, so that a button is not replaced under the pointer.
    const key = JSON.stringify(data);
    let node = document.getElementById(id);
    if (node && state.sections[id] === key) return node;
    state.sections[id] = key;
    const fresh = el("section", { id: id }, title ? el("h2", {}, title) : null, render(data));
    if (node) node.replaceWith(fresh);
    else document.getElementById("view").append(fresh);
    return fresh;
  }

  function table(headers, rows, attrs) {
    return el(
      "table",
      attrs || {},
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows),
    );
  }

  function pager(offset, limit, total, onMove) {
    if (total <= limit) return null;
    const last = Math.floor((total - 1) / limit) * limit;
    return el(
      "div",
      { class: "pager" },
      el("button", { disabled: offset === 0, onclick: () => onMove(Math.max(0, offset - limit)) }, "‹ newer"),
      " " + (offset + 1) + "–" + Math.min(total, offset + limit) + " of " + total + " ",
      el("button", { disabled: offset >= last, onclick: () => onMove(Math.min(last, offset + limit)) }, "older ›"),
    );
  }

  // -- the chart ----------------------------------------------------------------------------

  const SVG = "http://www.w3.org/2000/svg";

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    return node;
  }

  function chart(history, series, title, testid) {
    const width = 360;
    const height = 90;
    const box = el("figure", { class: "chart", "data-testid": testid, "data-samples": history.length });
    const plot = svg("svg", { viewBox: "0 0 " + width + " " + height, width: width, height: height, role: "img" });
    const now = Date.now() / 1000;
    const t0 = now - 3600;
    const max = Math.max(1, ...history.flatMap((s) => series.map((line) => s[line.field] || 0)));
    plot.append(svg("rect", { x: 0, y: 0, width: width, height: height, class: "plot" }));
    for (const line of series) {
      const points = history
        .filter((s) => s[line.field] !== null && s[line.field] !== undefined)
        .map((s) => {
          const x = ((s.t - t0) / 3600) * width;
          const y = height - 4 - ((s[line.field] || 0) / max) * (height - 8);
          return x.toFixed(1) + "," + y.toFixed(1);
        });
      if (points.length === 1) points.push(points[0].replace(/^[^,]+/, (x) => String(Number(x) + 2)));
      plot.append(svg("polyline", { points: points.join(" "), class: "line " + line.cls }));
    }
    const last = history.length ? history[history.length - 1] : {};
    box.append(
      plot,
      el(
        "figcaption",
        {},
        title + " (last hour, max " + fmtNum(max) + "): ",
        series.map((line) => el("span", { class: "key " + line.cls }, line.label + " " + fmtNum(last[line.field]))),
      ),
    );
    return box;
  }

  // -- views --------------------------------------------------------------------------------

  function workerRow(w) {
    const used = w.kv_blocks_used;
    const total = w.kv_blocks_total;
    return el(
      "tr",
      { "data-testid": "worker", "data-worker-id": w.id, "data-state": w.state },
      el("td", { class: "id" }, w.id),
      el("td", {}, w.host || "—"),
      el("td", {}, (w.device || "—") + (w.device_name ? " (" + w.device_name + ")" : "")),
      el("td", {}, w.model || "—"),
      el("td", {}, (w.dtype || "—") + (w.quantization ? " / " + w.quantization : "")),
      el("td", {}, w.adapters && w.adapters.length ? w.adapters.join(", ") : "—"),
      el(
        "td",
        { class: "kv", "data-testid": "worker-kv" },
        bar([[used, "used"], [total - used, "free"]], "kv-bar"),
        el("span", { "data-testid": "kv-text" }, fmtNum(used) + " / " + fmtNum(total)),
      ),
      el("td", { class: "num" }, fmtNum(w.num_running)),
      el("td", { class: "num" }, fmtNum(w.num_waiting)),
      el("td", { class: "num" }, fmtNum(w.output_tokens_per_s, 1)),
      el("td", { class: "num", "data-testid": "report-age" }, fmtAge(w.report_age_s)),
    );
  }

  function renderPool(pool) {
    const t = pool.totals;
    const cards = el(
      "div",
      { class: "cards" },
      card("live workers", t.live_workers, "total-live"),
      card("stopped", t.stopped_workers, "total-stopped"),
      card("KV blocks used", fmtNum(t.kv_blocks_used) + " / " + fmtNum(t.kv_blocks_total), "total-kv"),
      card("running", t.num_running, "total-running"),
      card("waiting in workers", t.num_waiting, "total-waiting"),
      card("output tok/s (1 min)", fmtNum(t.output_tokens_per_s, 1), "total-toks"),
    );
    const headers = ["worker", "host", "device", "model", "dtype / quant.", "adapters", "KV blocks", "running", "waiting", "tok/s", "report age"];
    const live = table(headers, pool.workers.map(workerRow), { "data-testid": "workers" });
    const pages = pager(pool.workers_offset, state.workerLimit, pool.workers_total, (o) => {
      state.workerOffset = o;
      refresh();
    });
    const stopped = pool.stopped.length
      ? el(
          "div",
          {},
          el("h3", {}, "Stopped reporting"),
          table(
            ["worker", "host", "device", "last report", "completed"],
            pool.stopped.map((w) =>
              el(
                "tr",
                { "data-testid": "stopped-worker", "data-worker-id": w.id, "data-state": "stopped" },
                el("td", { class: "id" }, w.id),
                el("td", {}, w.host || "—"),
                el("td", {}, w.device || "—"),
                el("td", {}, fmtAge(w.report_age_s) + " ago"),
                el("td", { class: "num" }, fmtNum(w.num_completed)),
              ),
            ),
            { "data-testid": "stopped-workers" },
          ),
        )
      : null;
    return [cards, live, pages, stopped];
  }

  function card(label, value, testid) {
    return el("div", { class: "card" }, el("div", { class: "value", "data-testid": testid }, fmtNum(value)), el("div", { class: "label" }, label));
  }

  function renderQueues(data) {
    const rows = [];
    for (const q of data.queues) {
      rows.push(
        el(
          "tr",
          { "data-testid": "queue", "data-queue": q.name },
          el("td", { class: "id" }, q.name),
          el("td", { class: "num", "data-testid": "queue-depth" }, fmtNum(q.depth)),
          el("td", { class: "num" }, fmtNum(q.in_flight)),
          el("td", { class: "num", "data-testid": "queue-demand" }, fmtNum(q.demand_blocks)),
          el("td", { class: "num" }, fmtNum(q.capacity_blocks)),
          el("td", { class: "num" }, fmtNum(q.desired_workers)),
          el("td", { class: "num" }, fmtAge(q.oldest_waiting_age_s)),
          el("td", { class: "num", "data-testid": "queue-dead" }, fmtNum(q.dead_letters)),
        ),
      );
      for (const lane of q.lanes) {
        rows.push(
          el(
            "tr",
            { class: "lane", "data-testid": "lane", "data-lane": lane.name },
            el("td", { class: "id" }, "↳ " + lane.kind + ": " + lane.name),
            el("td", { class: "num" }, fmtNum(lane.depth)),
            el("td", { class: "num" }, fmtNum(lane.in_flight)),
            el("td", { class: "num" }, fmtNum(lane.waiting_blocks) + " waiting"),
            el("td", {}, ""),
            el("td", {}, ""),
            el("td", { class: "num" }, fmtAge(lane.oldest_waiting_age_s)),
            el("td", {}, ""),
          ),
        );
      }
    }
    return table(["queue / lane", "depth", "in flight", "KV demand (blocks)", "capacity / worker", "desired workers", "oldest waiting", "dead letters"], rows, {
      "data-testid": "queues",
    });
  }

  function renderHistory(history) {
    return el(
      "div",
      { class: "charts" },
      chart(history, [{ field: "depth", label: "depth", cls: "a" }, { field: "in_flight", label: "in flight", cls: "b" }], "Queue depth", "chart-depth"),
      chart(history, [{ field: "demand_blocks", label: "KV demand", cls: "a" }, { field: "kv_blocks_total", label: "pool KV", cls: "b" }], "KV blocks", "chart-demand"),
      chart(history, [{ field: "workers", label: "workers", cls: "a" }, { field: "desired_workers", label: "desired", cls: "b" }], "Workers", "chart-workers"),
    );
  }

  function batchProgress(b) {
    const completed = b.completed || 0;
    const failed = b.failed || 0;
    const remaining = b.remaining === null || b.remaining === undefined ? 0 : b.remaining;
    const percent = Math.round((b.progress || 0) * 100);
    return el(
      "div",
      { class: "progress", "data-testid": "batch-progress", "data-progress": percent },
      bar([[completed, "done"], [failed, "failed"], [remaining, "free"]], "batch-bar", completed + " done, " + failed + " failed, " + remaining + " remaining"),
      el("span", { "data-testid": "batch-percent" }, percent + "%"),
    );
  }

  function codes(errors) {
    const entries = Object.entries(errors || {});
    return entries.length ? entries.map(([code, n]) => code + ": " + n).join(", ") : "—";
  }

  function batchRow(b) {
    return el(
      "tr",
      { "data-testid": "batch", "data-batch-id": b.id, "data-status": b.status },
      el("td", { class: "id" }, el("a", { href: "#/batch/" + encodeURIComponent(b.id) }, b.id)),
      el("td", {}, b.source === "api" ? "Batches API" : "qworker batch"),
      el("td", { "data-testid": "batch-status" }, b.status),
      el("td", { class: "wide" }, batchProgress(b)),
      el("td", { class: "num" }, fmtNum(b.done) + " / " + fmtNum(b.total)),
      el("td", { class: "num" }, fmtNum(b.rows_per_s, 2)),
      el("td", { class: "num" }, b.eta_s === null || b.eta_s === undefined ? "—" : fmtAge(b.eta_s)),
      el("td", {}, codes(b.errors_by_code)),
    );
  }

  function renderBatches(batches) {
    if (!batches.total) return el("p", { class: "empty" }, "No batch in the result store.");
    return [
      table(["batch", "from", "status", "progress", "rows", "rows/s", "ETA", "errors by code"], batches.items.map(batchRow), { "data-testid": "batches" }),
      pager(batches.offset, state.batchLimit, batches.total, (o) => {
        state.batchOffset = o;
        refresh();
      }),
    ];
  }

  async function act(path, body, question) {
    if (!window.confirm(question)) return;
    try {
      const result = await api(path, {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": state.session.csrf_token || "" },
        body: JSON.stringify(body),
      });
      setStatus("done: " + JSON.stringify(result), true);
      state.sections = {};
      refresh();
    } catch (e) {
      setStatus("action refused: " + e.message, false);
    }
  }

  function letterRow(d) {
    return el(
      "tr",
      { "data-testid": "dead-letter", "data-letter-id": d.id, "data-job-id": d.job_id || "" },
      el("td", { class: "id" }, d.id),
      el("td", { class: "id" }, d.job_id ? el("a", { href: "#/job/" + encodeURIComponent(d.job_id) }, d.job_id) : "—"),
      el("td", { class: "num" }, fmtNum(d.attempts)),
      el("td", { class: "num" }, fmtAge(d.age_s)),
      el("td", { class: "reason", "data-testid": "dead-letter-reason" }, d.reason),
      el(
        "td",
        {},
        state.session.can_act
          ? el(
              "button",
              {
                "data-testid": "replay",
                onclick: () => act("/dead-letters/replay", { ids: [d.id] }, "Replay dead letter " + d.id + " (job " + (d.job_id || "?") + ") onto the queue?"),
              },
              "Replay",
            )
          : null,
      ),
    );
  }

  function renderLetters(data) {
    const items = data.items;
    const actions = state.session.can_act && items.length
      ? el(
          "div",
          { class: "actions" },
          el("button", { "data-testid": "replay-all", onclick: () => act("/dead-letters/replay", { all: true }, "Replay every dead letter onto the queue?") }, "Replay all"),
          " ",
          el("button", { class: "danger", "data-testid": "purge", onclick: () => act("/dead-letters/purge", { confirm: "purge" }, "Remove every dead letter for good?") }, "Purge all"),
        )
      : null;
    if (!items.length) return el("p", { class: "empty" }, "No dead letters.");
    return [
      el("p", {}, (data.count === null || data.count === undefined ? items.length : data.count) + " dead letters; the newest:"),
      table(["dead letter", "job", "attempts", "age", "reason", ""], items.map(letterRow), { "data-testid": "dead-letters" }),
      actions,
    ];
  }

  async function viewOverview(generation) {
    const q = "?batch_offset=" + state.batchOffset + "&batch_limit=" + state.batchLimit + "&worker_offset=" + state.workerOffset + "&worker_limit=" + state.workerLimit;
    const data = await api("/overview" + q);
    if (generation !== state.generation) return;
    section("pool", "Pool", data.pool, renderPool);
    section("queues", "Queues", { queues: data.queues }, renderQueues);
    section("history", "Last hour", data.history, renderHistory);
    section("batches", "Batches", data.batches, renderBatches);
    section("letters", "Dead letters", { items: data.dead_letters.newest, count: data.dead_letters.count, can: state.session.can_act }, renderLetters);
  }

  async function viewBatch(generation, batchId) {
    const data = await api("/batches/" + encodeURIComponent(batchId) + "?offset=" + state.failedOffset + "&limit=" + state.failedLimit);
    if (generation !== state.generation) return;
    const b = data.batch;
    section("batch", "Batch", b, () => [
      el("h3", { class: "id", "data-testid": "batch-id" }, b.id),
      el(
        "dl",
        { class: "facts" },
        fact("status", b.status, "batch-status"),
        fact("from", b.source === "api" ? "Batches API" : "qworker batch --queue"),
        fact("endpoint", b.endpoint || "—"),
        fact("rows", fmtNum(b.done) + " of " + fmtNum(b.total) + " (" + fmtNum(b.completed) + " done, " + fmtNum(b.failed) + " failed, " + fmtNum(b.remaining) + " remaining)", "batch-rows"),
        fact("rows/s", fmtNum(b.rows_per_s, 2)),
        fact("ETA", b.eta_s === null || b.eta_s === undefined ? "—" : fmtAge(b.eta_s)),
        fact("created", fmtTime(b.created_at)),
        fact("started", fmtTime(b.started_at)),
        fact("finished", fmtTime(b.finished_at)),
        fact("errors by code", codes(b.errors_by_code), "batch-codes"),
      ),
      batchProgress(b),
    ]);
    section("failed", "Failed rows", data.failed_rows, (rows) => {
      if (!rows.total) return el("p", { class: "empty" }, "No failed row.");
      return [
        table(
          ["custom_id", "code", "status", "error"],
          rows.items.map((r) =>
            el("tr", { "data-testid": "failed-row", "data-custom-id": r.custom_id }, el("td", { class: "id" }, r.custom_id), el("td", {}, r.code), el("td", { class: "num" }, fmtNum(r.status_code)), el("td", { class: "reason" }, r.message)),
          ),
          { "data-testid": "failed-rows" },
        ),
        pager(rows.offset, state.failedLimit, rows.total, (o) => {
          state.failedOffset = o;
          refresh();
        }),
      ];
    });
  }

  function fact(name, value, testid) {
    return [el("dt", {}, name), el("dd", testid ? { "data-testid": testid } : {}, value)];
  }

  async function viewJob(generation, jobId) {
    const data = await api("/jobs/" + encodeURIComponent(jobId));
    if (generation !== state.generation) return;
    section("job", "Job", data, () => {
      const r = data.result;
      if (!r) {
        return [
          el("h3", { class: "id", "data-testid": "job-id" }, data.id),
          el("dl", { class: "facts" }, fact("status", data.status, "job-status"), fact("tokens so far", fmtNum(data.stream_tokens)), fact("last error", data.last_error || "—")),
          el("h3", {}, "Stream so far"),
          el("pre", { "data-testid": "job-text" }, data.stream_text || ""),
        ];
      }
      const timings = r.timings || {};
      return [
        el("h3", { class: "id", "data-testid": "job-id" }, data.id),
        el(
          "dl",
          { class: "facts" },
          fact("status", r.status, "job-status"),
          fact("attempts", fmtNum(r.attempts), "job-attempts"),
          fact("worker", r.worker || "—", "job-worker"),
          fact("finish reason", r.finish_reason || "—"),
          fact("tokens", fmtNum((r.usage || {}).prompt_tokens) + " prompt, " + fmtNum((r.usage || {}).completion_tokens) + " completion"),
          fact("error", r.error ? r.error.type + ": " + r.error.message : "—", "job-error"),
        ),
        el("h3", {}, "Timings"),
        table(["", "value"], Object.entries(timings).map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", { class: "num" }, typeof v === "number" && v > 1e9 ? fmtTime(v) : fmtNum(v, 3))))),
        el("h3", {}, "Text"),
        el("pre", { "data-testid": "job-text" }, r.text || ""),
      ];
    });
  }

  async function viewLetters(generation) {
    const data = await api("/dead-letters?limit=100");
    if (generation !== state.generation) return;
    section("letters", "Dead letters", { items: data.items, count: null, can: state.session.can_act }, renderLetters);
  }

  // -- the loop -----------------------------------------------------------------------------

  function route() {
    const hash = location.hash || "#/";
    let match = hash.match(/^#\/batch\/(.+)$/);
    if (match) return (g) => viewBatch(g, decodeURIComponent(match[1]));
    match = hash.match(/^#\/job\/(.+)$/);
    if (match) return (g) => viewJob(g, decodeURIComponent(match[1]));
    if (hash === "#/dead-letters") return viewLetters;
    return viewOverview;
  }

  async function refresh() {
    clearTimeout(state.timer);
    const generation = state.generation;
    const started = Date.now();
    try {
      if (!document.hidden) {
        await route()(generation);
        setStatus("updated " + new Date().toLocaleTimeString(), true);
      }
    } catch (e) {
      setStatus(e.status === 401 ? "not signed in (401): reload and give the API key" : "update failed: " + e.message, false);
    }
    if (generation !== state.generation) return;
    // At most one request a second, whatever the server's speed.
    const wait = Math.max(1000, state.session.refresh_ms) - (Date.now() - started);
    state.timer = setTimeout(refresh, Math.max(wait, 250));
  }

  function navigate() {
    state.generation += 1;
    state.sections = {};
    state.failedOffset = 0;
    document.getElementById("view").replaceChildren();
    refresh();
  }

  async function start() {
    try {
      state.session = await api("/session");
    } catch (e) {
      setStatus("no session: " + e.message, false);
    }
    document.getElementById("role").textContent = "role: " + state.session.role + (state.session.can_act ? "" : " (read only)");
    document.getElementById("job-search").addEventListener("submit", (event) => {
      event.preventDefault();
      const id = document.getElementById("job-id").value.trim();
      if (id) location.hash = "#/job/" + encodeURIComponent(id);
    });
    window.addEventListener("hashchange", navigate);
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) refresh();
    });
    navigate();
  }

  document.addEventListener("DOMContentLoaded", start);
})();

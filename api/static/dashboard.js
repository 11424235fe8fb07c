// Umbra Compute live dashboard: snapshots from /v1/projections/{queue,nodes},
// then live changes from the /v1/projections/stream Server-Sent Events.
// No framework, no build step. Everything from the server is inserted as text
// (textContent), never as HTML.
"use strict";

(() => {
  const KEY_STORAGE = "umbra.apiKey";
  const STATUSES = ["queued", "running", "blocked", "complete", "partial", "failed", "cancelled"];
  const $ = (id) => document.getElementById(id);

  let apiKey = null;
  let source = null;
  let retryTimer = null;
  let retryDelay = 1000;
  let refreshTimer = null;
  const view = { queue: null, nodes: null, position: 0 };
  let generation = 0; // bumped when the key changes: what was read before belongs to the previous key

  // -- helpers ---------------------------------------------------------------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") el.className = value;
      else if (name === "style") el.style.cssText = value;
      else el.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  const shortId = (id) => (id ? String(id).slice(0, 8) : "—");

  function mb(n) {
    if (n === null || n === undefined) return "—";
    return n >= 1024 ? `${(n / 1024).toFixed(n >= 10240 ? 0 : 1)} GB` : `${n} MB`;
  }

  function ago(iso) {
    if (!iso) return "—";
    const s = Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000));
    if (s < 60) return `${s}s ago`;
    if (s < 3600) return `${Math.floor(s / 60)}m ago`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
    return `${Math.floor(s / 86400)}d ago`;
  }

  function until(iso) {
    if (!iso) return "—";
    const s = Math.round((Date.parse(iso) - Date.now()) / 1000);
    return s >= 0 ? `${s}s` : "expired";
  }

  // -- connection state ---------------------------------------------------------

  function setState(state, text) {
    const pill = $("conn-state");
    pill.dataset.state = state;
    pill.textContent = text || { live: "live", connecting: "connecting…", reconnecting: "reconnecting", idle: "not connected" }[state];
    $("banner").hidden = state !== "reconnecting";
    document.body.dataset.connection = state;
  }

  function askForKey(message) {
    closeStream();
    setState("idle");
    $("key-panel").hidden = false;
    $("change-key").hidden = true;
    $("key-error").hidden = !message;
    $("key-error").textContent = message || "";
    $("key-input").focus();
  }

  // A key given in the address ("#key=…") is taken out of it at once, so that it stays in neither the
  // address bar nor the history. Looked for on load and whenever the fragment changes: opening that link
  // in a tab already showing the dashboard changes only the fragment, and the page is not loaded again.
  function keyFromAddress() {
    const match = location.hash.match(/[#&]key=([^&]+)/);
    if (!match) return null;
    history.replaceState(null, "", location.pathname + location.search);
    return decodeURIComponent(match[1]);
  }

  function useKey(key) {
    localStorage.setItem(KEY_STORAGE, key);
    if (key !== apiKey) forgetViews();  // another key may be another organization: its log positions are its own
    apiKey = key;
    retryDelay = 1000;
    connect();
  }

  class AuthError extends Error {}

  async function api(path) {
    const response = await fetch(path, { headers: { Authorization: `Bearer ${apiKey}`, Accept: "application/json" } });
    if (response.status === 401 || response.status === 403) {
      let message = `The server refused this key (${response.status}).`;
      try { message = (await response.json()).message || message; } catch (_) { /* keep the default */ }
      throw new AuthError(message);
    }
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  // -- data ---------------------------------------------------------------------------

  async function refresh() {
    const asked = generation;
    try {
      const [queue, nodes] = await Promise.all([api("/v1/projections/queue"), api("/v1/projections/nodes")]);
      if (asked !== generation) return;  // read with a key since replaced: another organization's views
      applyQueue(queue);
      applyNodes(nodes);
    } catch (error) {
      if (asked !== generation) return;
      if (error instanceof AuthError) askForKey(error.message);
      else scheduleReconnect();
    }
  }

  function refreshSoon() {
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(refresh, 120);
  }

  function newer(previous, next) {
    return !previous || typeof next.position !== "number" || next.position >= (previous.position || 0);
  }

  function applyQueue(queue) {
    if (!queue || !newer(view.queue, queue)) return;
    view.queue = queue;
    notePosition(queue.position);
    renderQueue();
  }

  function applyNodes(nodes) {
    if (!nodes || !newer(view.nodes, nodes)) return;
    view.nodes = nodes;
    notePosition(nodes.position);
    renderNodes();
    renderQueue(); // node names in the running table
  }

  // What is on screen belongs to the key that read it. Positions are per organization, so a snapshot of
  // another organization's views, read with a new key, could be older than the one shown and would be
  // dropped as stale: the previous organization's jobs and nodes stayed on screen under the new key.
  function forgetViews() {
    generation += 1;
    view.queue = null;
    view.nodes = null;
    view.position = 0;
    explanations.clear();
    for (const id of ["running-table", "blocked-table", "waiting-table"]) $(id)?.tBodies[0].replaceChildren();
    for (const status of STATUSES) $(`count-${status}`).textContent = "0";
    $("queue-total").textContent = "";
    $("nodes").replaceChildren();
    $("nodes-summary").textContent = "";
    $("position").textContent = "";
  }

  function notePosition(position) {
    if (typeof position === "number" && position > view.position) view.position = position;
    $("position").textContent = `log #${view.position}`;
  }

  // A stream message carries a whole view ({"view": "queue", ...} or the
  // snapshot shape itself); anything else means "something changed": re-read.
  function onStreamMessage(event) {
    let data;
    try { data = JSON.parse(event.data); } catch (_) { refreshSoon(); return; }
    const name = data.view || (event.type !== "message" ? event.type : null);
    const body = data.data && typeof data.data === "object" ? { position: data.position, ...data.data } : data;
    if ((name === "queue" || (!name && body.counts)) && body.counts) applyQueue(body);
    else if ((name === "nodes" || (!name && body.nodes)) && body.nodes) applyNodes(body);
    else refreshSoon();
  }

  // -- stream -------------------------------------------------------------------------

  function closeStream() {
    if (source) { source.abort(); source = null; }
    clearTimeout(retryTimer);
  }

  function scheduleReconnect() {
    closeStream();
    setState("reconnecting");
    retryTimer = setTimeout(connect, retryDelay);
    retryDelay = Math.min(retryDelay * 2, 15000);
  }

  // The server sends a ": ping" line after 15 s of silence, so a stream that says nothing for STALL_MS
  // is one whose server went away without closing it (its host gone, the network dropped, a laptop woken
  // from sleep): it is given up and connected again, instead of being called live for ever.
  const STALL_MS = 45000;

  // The stream is read with fetch rather than EventSource: EventSource cannot
  // send an Authorization header, and a key in the URL would be written down
  // by every proxy log and browser history it passed through.
  function connect() {
    closeStream();
    if (!apiKey) { askForKey(); return; }
    $("key-panel").hidden = true;
    $("change-key").hidden = false;
    if ($("conn-state").dataset.state !== "reconnecting") setState("connecting");
    const stream = new AbortController();
    source = stream;
    let stalled = null;
    const heard = () => {
      clearTimeout(stalled);
      stalled = setTimeout(() => stream.abort(), STALL_MS);
    };
    heard();
    readStream(stream, heard).then(() => {
      if (source === stream) scheduleReconnect();  // the server ended it (shutting down, say)
    }, () => {
      if (source === stream) scheduleReconnect();  // the connection dropped, or went silent
    }).finally(() => clearTimeout(stalled));
  }

  async function readStream(stream, heard) {
    const response = await fetch("/v1/projections/stream?views=queue,nodes", {
      headers: { Authorization: `Bearer ${apiKey}`, Accept: "text/event-stream" },
      cache: "no-store",
      signal: stream.signal,
    });
    if (source !== stream) return;
    if (response.status === 401 || response.status === 403) {
      let message = `The server refused this key (${response.status}).`;
      try { message = (await response.json()).message || message; } catch (_) { /* keep the default */ }
      source = null;
      askForKey(message);
      return;
    }
    if (!response.ok || !response.body) throw new Error(`stream: HTTP ${response.status}`);
    retryDelay = 1000;
    setState("live");
    refresh();
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let type = "message";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done || source !== stream) return;
      heard();
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line === "") {  // a blank line ends one message
          if (data.length) onStreamMessage({ type, data: data.join("\n") });
          type = "message";
          data = [];
        } else if (!line.startsWith(":")) {  // ":" lines are heartbeats
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") type = text;
          else if (field === "data") data.push(text);
        }
      }
    }
  }

  // -- rendering ----------------------------------------------------------------------

  function nodeName(nodeId) {
    const node = (view.nodes?.nodes || []).find((n) => n.id === nodeId);
    return node ? node.name : shortId(nodeId);
  }

  // How far a running job is, as its agent last said with a renewal: "40% epoch 4 of 10", or a dash.
  function progressCell(progress) {
    if (!progress || (progress.fraction == null && !progress.message)) return h("span", { class: "reason" }, "—");
    const percent = progress.fraction == null ? null : `${Math.round(progress.fraction * 100)}%`;
    return h("span", { class: "progress", title: progress.message || "" },
      percent ? h("span", { class: "num" }, percent) : null, percent && progress.message ? " " : null,
      progress.message ? h("span", { class: "reason" }, progress.message) : null);
  }

  function placementCell(placement) {
    if (!placement) return h("span", { class: "reason" }, "—");
    // A CPU always runs from RAM: only a device with VRAM of its own running from RAM is the slow path.
    const slow = String(placement.reason || "").includes("slow_path");
    return h("span", {},
      slow ? h("span", { class: "badge slow", title: "Runs from system RAM: slower than VRAM" }, "slow path") : null,
      slow ? " " : null,
      h("span", { class: "reason" }, placement.reason || ""),
      placement.resident ? [" ", h("span", { class: "badge resident" }, "resident")] : null,
      (placement.would_evict || []).length ? [" ", h("span", { class: "badge evict", title: placement.would_evict.join(", ") }, "evicts")] : null);
  }

  function flash(tile) {
    tile.classList.add("flash");
    requestAnimationFrame(() => requestAnimationFrame(() => tile.classList.remove("flash")));
  }

  function renderQueue() {
    const queue = view.queue;
    if (!queue) return;
    const counts = queue.counts || {};
    let total = 0;
    for (const status of STATUSES) {
      const n = counts[status] || 0;
      total += n;
      const el = $(`count-${status}`);
      if (el.textContent !== String(n)) { el.textContent = String(n); flash(el.parentElement); }
    }
    $("queue-total").textContent = `${total} job${total === 1 ? "" : "s"}`;
    const jobs = queue.jobs || [];

    const running = jobs.filter((j) => j.status === "running" && j.placement);
    $("running-table").tBodies[0].replaceChildren(...running.map((j) => h("tr", { "data-job": j.id },
      h("td", { class: "id", title: j.id }, shortId(j.id)),
      h("td", {}, j.kind),
      h("td", { class: "progress-cell" }, progressCell(j.progress)),
      h("td", {}, nodeName(j.placement.node_id || j.lease_owner), " ", h("span", { class: "id nowrap" }, `· ${j.placement.device_id || j.placement.device_kind || ""}`)),
      h("td", {}, placementCell(j.placement)),
      h("td", { class: "num" }, `${j.attempt}/${j.max_attempts}`),
      h("td", { class: "num", "data-until": j.lease_expires_at || "" }, until(j.lease_expires_at)))));
    showEmpty("running", running.length, counts.running || 0, jobs.length, "Nothing is running.");

    const blocked = jobs.filter((j) => j.status === "blocked");
    $("blocked-table").tBodies[0].replaceChildren(...blocked.map((j, i) => h("tr", { "data-job": j.id },
      h("td", { class: "id", title: j.id }, shortId(j.id)),
      h("td", {}, j.kind),
      h("td", {}, h("span", { class: "reason" }, j.blocked_reason || j.error || "—"), explainCell(j, i)),
      h("td", { class: "num", "data-ago": j.created_at || "" }, ago(j.created_at)))));
    showEmpty("blocked", blocked.length, counts.blocked || 0, jobs.length, "No blocked jobs.");
    renderWaiting();
    forgetExplanations(new Set([...blocked, ...waitingJobs()].map((j) => j.id)));
  }

  // The view lists the first open jobs (running, then blocked, then queued): jobs of a status may be
  // counted and not listed, and an empty table must not then say there are none.
  function showEmpty(status, listed, counted, jobsListed, none) {
    const empty = $(`${status}-empty`);
    empty.hidden = listed > 0;
    empty.textContent = listed === 0 && counted > 0
      ? `${counted} ${status} job${counted === 1 ? "" : "s"}, not listed: the view lists the first ${jobsListed} open jobs.`
      : none;
  }

  // -- explanations ---------------------------------------------------------------------
  // Why a blocked job, or one queued longer than WAITING_SECONDS, is not running:
  // GET /v1/jobs/{id}/explain, fetched only for rows on screen (the first
  // MAX_EXPLAINED of each table) and kept for EXPLAIN_TTL_MS or until the job moves.

  const WAITING_SECONDS = 30;
  const EXPLAIN_TTL_MS = 10000;
  const MAX_EXPLAINED = 25;
  const explanations = new Map(); // job id -> { summary, at, position, pending }
  let waitingShown = "";

  function explainCell(job, index) {
    const cached = explanations.get(job.id);
    if (index < MAX_EXPLAINED) requestExplanation(job);
    return h("div", { class: "explain", "data-explain": job.id }, cached?.summary || (index < MAX_EXPLAINED ? "explaining…" : ""));
  }

  function requestExplanation(job) {
    const cached = explanations.get(job.id);
    if (cached && (cached.pending || (Date.now() - cached.at < EXPLAIN_TTL_MS && cached.position === job.position))) return;
    const entry = { summary: cached?.summary || null, at: 0, position: job.position, pending: true };
    explanations.set(job.id, entry);
    api(`/v1/jobs/${encodeURIComponent(job.id)}/explain`)
      .then((body) => { entry.summary = body.summary; }, () => { entry.summary = entry.summary || "no explanation available"; })
      .finally(() => {
        entry.pending = false;
        entry.at = Date.now();
        for (const el of document.querySelectorAll("[data-explain]")) {
          if (el.dataset.explain === job.id) el.textContent = entry.summary;
        }
      });
  }

  function forgetExplanations(shown) {
    for (const id of explanations.keys()) if (!shown.has(id)) explanations.delete(id);
  }

  function waitingJobs() {
    const cutoff = Date.now() - WAITING_SECONDS * 1000;
    return (view.queue?.jobs || []).filter((j) => j.status === "queued" && Date.parse(j.created_at) <= cutoff);
  }

  function renderWaiting() {
    const waiting = waitingJobs();
    waitingShown = waiting.map((j) => `${j.id}@${j.position}`).join(",");
    $("waiting-table").tBodies[0].replaceChildren(...waiting.map((j, i) => h("tr", { "data-job": j.id },
      h("td", { class: "id", title: j.id }, shortId(j.id)),
      h("td", {}, j.kind),
      h("td", {}, explainCell(j, i)),
      h("td", { class: "num", "data-ago": j.created_at || "" }, ago(j.created_at)))));
    // Queued jobs counted and not listed (the view lists running and blocked ones first) may be waiting too.
    const jobs = view.queue?.jobs || [];
    const unlisted = (view.queue?.counts?.queued || 0) - jobs.filter((j) => j.status === "queued").length;
    const empty = $("waiting-empty");
    empty.hidden = waiting.length > 0;
    empty.textContent = unlisted > 0
      ? `${unlisted} queued job${unlisted === 1 ? "" : "s"} not listed (the view lists the first ${jobs.length} open jobs): none of those listed has waited longer than ${WAITING_SECONDS} s.`
      : `No job has waited longer than ${WAITING_SECONDS} s.`;
  }

  function refreshExplanations() {
    if (!view.queue || !apiKey) return;
    const waiting = waitingJobs();
    if (waiting.map((j) => `${j.id}@${j.position}`).join(",") !== waitingShown) renderWaiting();
    const blocked = (view.queue.jobs || []).filter((j) => j.status === "blocked");
    for (const list of [blocked, waiting]) list.slice(0, MAX_EXPLAINED).forEach(requestExplanation);
  }

  function meter(label, total, free) {
    const used = Math.max(0, total - free);
    const share = total > 0 ? used / total : 0;
    const cls = share >= 0.97 ? "bar full" : share >= 0.8 ? "bar high" : "bar";
    return h("div", { class: "meter", title: `${mb(used)} used of ${mb(total)}` },
      h("span", {}, label),
      h("div", { class: cls }, h("span", { style: `width:${(share * 100).toFixed(1)}%` })),
      h("span", { class: "figure" }, `${mb(used)} / ${mb(total)}`));
  }

  function deviceBlock(device, cordoned) {
    const unified = device.kind !== "gpu_discrete";
    const busy = device.busy === true;  // the server's reading (a non-CPU device with no free VRAM)
    const models = device.resident_models || [];
    // Taken out of service by an operator (the node's "cordoned": {label: reason}); null reason: none given.
    const out = Object.prototype.hasOwnProperty.call(cordoned, device.label);
    return h("div", { class: "device", "data-device": device.label },
      h("div", { class: "device-head" },
        h("span", { class: "device-label" }, device.label, busy ? [" ", h("span", { class: "busy" }, "busy")] : null,
          out ? [" ", h("span", { class: "busy", title: cordoned[device.label] || "no reason given" }, "cordoned")] : null),
        h("span", { class: "device-kind" }, device.kind.replace("_", " "), (device.accelerators || []).length ? ` · ${device.accelerators.join(", ")}` : "")),
      device.vram_total_mb > 0 ? meter("VRAM", device.vram_total_mb, device.vram_free_mb) : null,
      unified && device.ram_total_mb > 0 ? meter("RAM", device.ram_total_mb, device.ram_free_mb) : null,
      models.length ? h("div", { class: "models" }, models.map((m) =>
        h("span", { class: "chip", title: `${mb(m.vram_held_mb)} held` }, m.slug, m.vram_held_mb ? ` · ${mb(m.vram_held_mb)}` : ""))) : null);
  }

  function renderNodes() {
    const nodes = view.nodes?.nodes || [];
    const online = nodes.filter((n) => n.status === "online").length;
    $("nodes-summary").textContent = nodes.length ? `${online} of ${nodes.length} online` : "";
    $("nodes-empty").hidden = nodes.length > 0;
    $("nodes").replaceChildren(...nodes.map((n) => h("article", { class: "node", "data-node": n.id },
      h("div", { class: "node-head" },
        h("span", { class: "node-name" }, n.name),
        h("span", {},
          h("span", { class: "status", "data-status": n.status }, n.status),
          n.stored_status && n.stored_status !== n.status ? h("span", { class: "stored", title: "stored status" }, `stored: ${n.stored_status}`) : null)),
      h("div", { class: "node-attrs" },
        h("span", {}, `trust: ${n.trust_domain || "local"}`),
        n.locality ? h("span", {}, n.locality) : null,
        n.agent_version ? h("span", {}, `agent ${n.agent_version}`) : null,
        h("span", { "data-ago": n.last_heartbeat_at || "" }, `heartbeat ${ago(n.last_heartbeat_at)}`),
        n.schedulable === false && n.status === "online" ? h("span", { class: "busy" }, "no free device") : null),
      (n.devices || []).map((device) => deviceBlock(device, n.cordoned || {})))));
  }

  function tick() {
    refreshExplanations();
    for (const el of document.querySelectorAll("[data-until]")) el.textContent = until(el.dataset.until);
    for (const el of document.querySelectorAll("[data-ago]")) {
      const prefix = el.textContent.startsWith("heartbeat") ? "heartbeat " : "";
      el.textContent = prefix + ago(el.dataset.ago);
    }
  }

  // -- start ------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      $("key-input").value = "";
      useKey(key);
    });
    $("change-key").addEventListener("click", () => {
      localStorage.removeItem(KEY_STORAGE);
      apiKey = null;
      askForKey();
    });
    window.addEventListener("hashchange", () => {
      const key = keyFromAddress();
      if (key) useKey(key);
    });
    setInterval(tick, 1000);
    apiKey = localStorage.getItem(KEY_STORAGE);
    const given = keyFromAddress();
    if (given) useKey(given);
    else if (apiKey) connect();
    else askForKey();
  });
})();

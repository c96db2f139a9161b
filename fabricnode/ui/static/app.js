// The fabric dashboard: a view over the agent's read-only JSON APIs (the ones `fabric` reads)
// and, in the playground, a client of its /v1 endpoint. It changes nothing in the mesh.
//
// Rules kept throughout: every piece of text from the server goes into the page through
// textContent or an attribute set by the DOM (never parsed as HTML), so nothing a node announces can
// run as script; only the view on screen polls, and nothing polls while the tab is hidden; the
// API key, when the agent needs one, lives in this tab's sessionStorage and goes only to this
// agent.
"use strict";

(() => {
  const KEY_STORE = "fabric.apiKey";
  const POLL_MS = { mesh: 2000, models: 5000, node: 3000, controller: 5000, playground: 0 };
  const STATS_WINDOW_S = 600;

  const $ = (id) => document.getElementById(id);
  const views = ["mesh", "models", "node", "controller", "playground"];
  const charts = new Map(); // chart id -> uPlot instance, for the view on screen
  let current = { view: "mesh", arg: "" };
  let timer = 0;
  let generation = 0; // bumps on every view change: late answers of an old view are dropped
  let session = null; // /ui/session: whether keys are on and what this key may read
  let lastUpdate = 0;
  let chat = null; // the playground's AbortController while a reply streams
  const engineOf = new Map(); // session id -> its engine command, once its agent told us

  // -- DOM helpers ---------------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else if (k in node && typeof v !== "string") node[k] = v;
      else node.setAttribute(k, String(v));
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  const fmt = {
    num(v, digits = 1) {
      if (v === null || v === undefined || Number.isNaN(v)) return "–";
      if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString();
      return Number(v).toFixed(digits).replace(/\.0+$/, "");
    },
    pct(v) {
      return v === null || v === undefined ? "–" : `${Math.round(v * 100)}%`;
    },
    secs(v) {
      if (v === null || v === undefined) return "–";
      return v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`;
    },
    age(unix) {
      if (!unix) return "–";
      const s = Math.max(0, Date.now() / 1000 - unix);
      if (s < 90) return `${Math.round(s)} s ago`;
      if (s < 5400) return `${Math.round(s / 60)} min ago`;
      return `${(s / 3600).toFixed(1)} h ago`;
    },
    time(unix) {
      return unix ? new Date(unix * 1000).toLocaleTimeString() : "–";
    },
    short(id) {
      return String(id || "").slice(0, 12);
    },
  };

  // -- the agent's APIs ------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function authHeaders(extra) {
    const headers = new Headers(extra || {});
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.set("Authorization", `Bearer ${key}`);
    return headers;
  }

  async function api(path, init) {
    const response = await fetch(path, {
      ...(init || {}),
      headers: authHeaders(init && init.headers),
      cache: "no-store",
      credentials: "omit",
    });
    if (!response.ok) {
      let message = `${response.status} ${response.statusText}`;
      try {
        const doc = await response.json();
        if (doc && doc.error && doc.error.message) message = doc.error.message;
      } catch (_) {
        // not JSON: keep the status line
      }
      if (response.status === 401) await refreshSession();
      throw new ApiError(response.status, message);
    }
    return response;
  }

  async function getJson(path) {
    return (await api(path)).json();
  }

  // Whether this agent wants a key, and what the one we hold may read. Asked before anything
  // else, so a page without a good key reads nothing (and collects no 401s).
  async function refreshSession() {
    const response = await fetch("/ui/session", {
      headers: authHeaders(),
      cache: "no-store",
      credentials: "omit",
    });
    session = await response.json();
    const needKey = session.keys_required && !session.key;
    $("key-form").hidden = !needKey;
    $("key-button").hidden = !session.keys_required;
    if (needKey) {
      setStatus(sessionStorage.getItem(KEY_STORE) ? "that key is not valid" : "needs an API key", true);
      $("key-input").focus();
    }
    return session;
  }

  function mayRead() {
    return session && (!session.keys_required || (session.key && session.admin));
  }

  function mayChat() {
    return session && (!session.keys_required || session.key);
  }

  // -- status line and notices ---------------------------------------------------------------

  function setStatus(text, stale) {
    const node = $("status");
    node.textContent = text;
    node.classList.toggle("stale", Boolean(stale));
  }

  function notice(text) {
    const node = $("notice");
    node.textContent = text || "";
    node.hidden = !text;
  }

  function updated() {
    lastUpdate = Date.now();
    setStatus(`live · updated ${new Date(lastUpdate).toLocaleTimeString()}`, false);
    notice("");
  }

  function failed(err) {
    if (err instanceof ApiError && err.status === 401) return; // the key form is showing
    if (err instanceof ApiError && err.status === 403) {
      notice("This API key may use the playground but not read the registry: an admin key is needed (fabric keys api-new NAME --admin).");
      setStatus("admin key needed", true);
      return;
    }
    const since = lastUpdate ? ` (last update ${Math.round((Date.now() - lastUpdate) / 1000)} s ago)` : "";
    setStatus(`stale: ${err.message}${since}`, true);
  }

  // -- views and polling -----------------------------------------------------------------------

  function parseHash() {
    const parts = location.hash.replace(/^#\/?/, "").split("/");
    const view = views.includes(parts[0]) ? parts[0] : "mesh";
    return { view, arg: decodeURIComponent(parts.slice(1).join("/")) };
  }

  function show() {
    current = parseHash();
    generation += 1;
    window.clearTimeout(timer);
    for (const chart of charts.values()) chart.destroy();
    charts.clear();
    for (const name of views) {
      $(`view-${name}`).hidden = name !== current.view;
    }
    for (const link of document.querySelectorAll("nav a[data-view]")) {
      if (link.dataset.view === current.view) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    if (current.view === "playground") {
      loadModels();
      return;
    }
    poll();
  }

  async function poll() {
    window.clearTimeout(timer);
    const mine = generation;
    if (document.hidden) return; // resumed by visibilitychange
    if (!session || !mayRead()) {
      await refreshSession().catch(failed);
    }
    if (mayRead()) {
      try {
        await renderers[current.view](mine, current.arg);
        if (mine === generation) updated();
      } catch (err) {
        if (mine === generation) failed(err);
      }
    } else if (session && session.key && !session.admin) {
      failed(new ApiError(403, "admin key needed"));
    }
    const every = POLL_MS[current.view];
    if (mine === generation && every) timer = window.setTimeout(poll, every);
  }

  // -- Mesh ------------------------------------------------------------------------------------

  function meshQuery() {
    const form = $("mesh-filters");
    const q = new URLSearchParams();
    for (const name of ["state", "model", "gpu", "site"]) {
      const value = form.elements[name].value.trim();
      if (value) q.set(name, value);
    }
    const label = form.elements.label.value.trim();
    if (label.includes("=")) q.set("label", label);
    return q.toString();
  }

  function stateCell(state) {
    return el("td", {}, el("span", { class: `state state-${state}`, text: state }));
  }

  function liveCell(liveness) {
    return el("td", {}, el("span", { class: `live live-${liveness}`, text: liveness }));
  }

  function loadCell(load) {
    if (!load) return el("td", { class: "loadcell", text: "no report" });
    return el(
      "td",
      { class: "loadcell" },
      el("meter", { min: 0, max: 1, low: 0.6, high: 0.9, optimum: 0, value: load.kv_usage || 0, title: "KV cache in use" }),
      el("span", { text: `KV ${fmt.pct(load.kv_usage)} · ${load.running} running · ${load.waiting} waiting` }),
    );
  }

  function gpus(hw) {
    if (!hw || !hw.gpu_count) return "none";
    return `${hw.gpu_count} × ${hw.gpu_type || "GPU"}`;
  }

  function nodeRow(n) {
    const models = (n.models || []).map((m) => m.id).join(", ") || "–";
    return el(
      "tr",
      { class: n.liveness === "dead" ? "dead" : "", dataset: { session: n.session_id } },
      el("td", {}, el("a", { href: `#/node/${encodeURIComponent(n.session_id)}`, class: "mono", title: n.session_id, text: fmt.short(n.session_id) })),
      el("td", { text: n.provider }),
      stateCell(n.state),
      liveCell(n.liveness),
      el("td", { class: "wide-only", text: (n.hardware && n.hardware.host) || "–" }),
      el("td", { text: gpus(n.hardware) }),
      el("td", { text: models }),
      el("td", { class: "wide-only", text: n.engine && n.engine.kind ? `${n.engine.kind} ${n.engine.version || ""}` : "–" }),
      loadCell(n.load),
    );
  }

  function nodeTable(nodes) {
    const head = el(
      "tr",
      {},
      ...["Node", "Provider", "State", "Liveness"].map((h) => el("th", { text: h })),
      el("th", { class: "wide-only", text: "Host" }),
      el("th", { text: "GPUs" }),
      el("th", { text: "Models" }),
      el("th", { class: "wide-only", text: "Engine" }),
      el("th", { text: "Load" }),
    );
    return el("table", {}, el("thead", {}, head), el("tbody", {}, ...nodes.map(nodeRow)));
  }

  async function renderMesh(mine) {
    const doc = await getJson(`/fabric/v1/nodes?${meshQuery()}`);
    if (mine !== generation) return;
    const nodes = doc.nodes || [];
    const count = (pred) => nodes.filter(pred).length;
    $("mesh-summary").textContent =
      `${nodes.length} node${nodes.length === 1 ? "" : "s"}: ` +
      `${count((n) => n.state === "serving")} serving, ${count((n) => n.state === "join")} joining, ` +
      `${count((n) => n.state === "down")} down, ${count((n) => n.state === "left")} left; ` +
      `${count((n) => n.liveness === "alive")} alive, ${count((n) => n.liveness === "suspect")} suspect, ` +
      `${count((n) => n.liveness === "dead")} dead`;
    const by = $("mesh-filters").elements.group.value;
    const sites = groupBy(nodes, (n) => [siteOf(n)]);
    $("mesh-summary").textContent += sites.size > 1
      ? `; ${sites.size} sites`
      : sites.size ? `; site ${[...sites.keys()][0]}` : "";
    const box = $("mesh-groups");
    clear(box);
    if (!nodes.length) box.append(el("p", { class: "summary", text: "No node matches." }));
    // Nodes of several sites: a section per site, the chosen groups inside it.
    if (sites.size > 1 && by !== "site") {
      for (const site of [...sites.keys()].sort()) {
        const members = sites.get(site);
        box.append(
          el(
            "section",
            { class: "site", dataset: { site } },
            el("h2", {}, `site ${site}`, " ", el("span", { class: "count", text: `(${members.length})` })),
            ...nodeGroups(members, by, "h3"),
          ),
        );
      }
      return;
    }
    box.append(...nodeGroups(nodes, by, "h2"));
  }

  function siteOf(n) {
    return n.site || "default"; // an agent from before sites shows none
  }

  // Map of key -> the nodes `keysOf` files under it (a node may be under several).
  function groupBy(nodes, keysOf) {
    const groups = new Map();
    for (const n of nodes) {
      for (const key of keysOf(n)) {
        if (!groups.has(key)) groups.set(key, []);
        groups.get(key).push(n);
      }
    }
    return groups;
  }

  function nodeGroups(nodes, by, heading) {
    const groups = groupBy(nodes, (n) => {
      if (by === "model") return (n.models || []).length ? n.models.map((m) => m.id) : ["(no model)"];
      if (by === "host") return [(n.hardware && n.hardware.host) || "(unknown host)"];
      if (by === "site") return [siteOf(n)];
      return ["all nodes"];
    });
    return [...groups.keys()].sort().map((key) => {
      const members = groups.get(key);
      return el(
        "div",
        { class: "group", dataset: { group: key } },
        el(heading, {}, key, " ", el("span", { class: "count", text: `(${members.length})` })),
        nodeTable(members),
      );
    });
  }

  // -- charts ----------------------------------------------------------------------------------

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
  }

  const PALETTE = ["--accent", "--ok", "--warn", "--bad", "--muted"];

  // The charts' time window: the last ten minutes, whatever the data covers (a single point
  // would otherwise stretch the axis over years).
  function lastMinutes() {
    const now = Date.now() / 1000;
    return [now - STATS_WINDOW_S, now];
  }

  // A uPlot chart in `box`, made once per view and fed new data on every poll. A series may
  // name its own scale (`scale`, `axisLabel`): it gets an axis on the right.
  function chart(id, box, series, data, yLabel) {
    let u = charts.get(id);
    if (u && u.root.isConnected) {
      u.setData(data);
      return u;
    }
    if (u) u.destroy();
    const width = Math.max(240, box.clientWidth || 320);
    const axis = { stroke: cssVar("--muted"), grid: { stroke: cssVar("--line") } };
    const axes = [{ ...axis }, { ...axis, label: yLabel, size: 56 }];
    const scales = { x: { time: true, range: () => lastMinutes() }, y: { range: (u, lo, hi) => [0, Math.max(hi, 1e-3) * 1.1] } };
    for (const s of series) {
      if (!s.scale || scales[s.scale]) continue;
      scales[s.scale] = { range: (u, lo, hi) => [0, Math.max(hi, 1e-3) * 1.1] };
      axes.push({ ...axis, grid: { show: false }, scale: s.scale, side: 1, label: s.axisLabel, size: 60 });
    }
    const opts = {
      width,
      height: 180,
      scales,
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      axes,
      series: [
        {},
        ...series.map((s, i) => ({
          label: s.label,
          scale: s.scale || "y",
          stroke: cssVar(s.color || PALETTE[i % PALETTE.length]),
          width: 1.5,
          dash: s.dash,
          spanGaps: false,
          points: { size: 4 },
        })),
      ],
    };
    u = new uPlot(opts, data, box);
    charts.set(id, u);
    return u;
  }

  function resizeCharts() {
    for (const u of charts.values()) {
      const box = u.root.parentElement;
      if (box && box.clientWidth) u.setSize({ width: box.clientWidth, height: 180 });
    }
  }

  // -- Models ----------------------------------------------------------------------------------

  function figure(label, value, name) {
    return el("div", {}, el("dt", { text: label }), el("dd", { text: value, dataset: { figure: name } }));
  }

  async function renderModels(mine) {
    const [models, stats, nodes, fleet] = await Promise.all([
      getJson("/fabric/v1/models"),
      getJson(`/fabric/v1/stats?window=${STATS_WINDOW_S}`),
      getJson("/fabric/v1/nodes"),
      getJson("/fabric/v1/fleet"),
    ]);
    if (mine !== generation) return;
    const ctl = fleet.controller || {};
    const planned = new Map((ctl.models || []).map((m) => [m.model, m]));
    const objectives = ctl.objectives || {};
    const perModel = stats.models || {};
    const agents = stats.agents || { asked: 1, answered: 1 };
    $("models-summary").textContent =
      `Rates and latencies of the last minute, from ${agents.answered} of ${agents.asked} agents; ` +
      "charts over the last 10 minutes. Latencies are of interactive requests.";
    const ids = new Set((models.models || []).map((m) => m.id));
    for (const id of Object.keys(perModel)) ids.add(id);
    const box = $("models-list");
    const seen = new Set();
    if (ids.size && box.querySelector(":scope > p")) clear(box); // the "no model" line
    for (const id of [...ids].sort()) {
      const position = seen.size;
      seen.add(id);
      const m = (models.models || []).find((x) => x.id === id) || { id, nodes: 0, serving: 0, load: {} };
      const s = perModel[id] || null;
      const sum = s ? s.summary : {};
      const starting = (nodes.nodes || []).filter(
        (n) => n.state === "join" && n.liveness === "alive" && (n.models || []).some((x) => x.id === id),
      ).length;
      const plan = planned.get(id);
      let card = box.querySelector(`[data-model="${CSS.escape(id)}"]`);
      if (card && Boolean(card.querySelector(".chart")) !== Boolean(s)) {
        card.remove(); // requests started or stopped: built again with or without charts
        card = null;
      }
      if (!card) {
        card = el(
          "article",
          { class: "card", dataset: { model: id } },
          el("h2", { text: id }),
          el("dl", { class: "figures" }),
          ...(s
            ? [
              el("h3", { text: "Throughput" }),
              el("div", { class: "chart", dataset: { chart: "rate" } }),
              el("h3", { text: "Latency" }),
              el("div", { class: "chart", dataset: { chart: "latency" } }),
            ]
            : [el("p", { class: "summary", text: "No request for this model through the mesh in the last 10 minutes." })]),
        );
      }
      if (box.children[position] !== card) box.insertBefore(card, box.children[position] || null);
      const dl = card.querySelector(".figures");
      clear(dl);
      const load = m.load || {};
      dl.append(
        figure("requests/s", fmt.num(sum.requests_per_s, 2), "requests_per_s"),
        figure("output tokens/s", fmt.num(sum.output_tokens_per_s), "output_tokens_per_s"),
        figure("TTFT p50 / p95", `${fmt.secs(sum.ttft_p50_s)} / ${fmt.secs(sum.ttft_p95_s)}`, "ttft"),
        figure("end-to-end p50 / p95", `${fmt.secs(sum.e2e_p50_s)} / ${fmt.secs(sum.e2e_p95_s)}`, "e2e"),
        figure("queue (waiting)", fmt.num(load.waiting, 0), "waiting"),
        figure("running", fmt.num(load.running, 0), "running"),
        figure("KV cache (mean)", fmt.pct(load.kv_usage), "kv"),
        figure("replicas serving", `${m.serving} of ${m.nodes}`, "serving"),
        figure("replicas by site", (m.sites || []).map((x) => `${x.site}: ${x.nodes}`).join(" · ") || "–", "sites"),
        figure("starting", String(plan ? plan.starting : starting), "starting"),
        figure("pending (Slurm)", plan ? String(plan.pending) : "–", "pending"),
        figure("errors (last min)", fmt.num(sum.errors, 0), "errors"),
        figure("TTFT objective", objectives[id] ? fmt.secs(objectives[id]) : "none", "objective"),
      );
      if (s) {
        const t = s.series.t;
        chart(`${id}/rate`, card.querySelector('[data-chart="rate"]'),
          [{ label: "requests/s" }, { label: "output tokens/s", color: "--ok", scale: "tokens", axisLabel: "tokens/s" }],
          [t, s.series.requests_per_s, s.series.output_tokens_per_s], "requests/s");
        const latency = [
          { label: "TTFT p50" },
          { label: "TTFT p95", color: "--warn" },
          { label: "e2e p95", color: "--ok" },
        ];
        const data = [t, s.series.ttft_p50_s, s.series.ttft_p95_s, s.series.e2e_p95_s];
        if (objectives[id]) {
          latency.push({ label: "TTFT objective", color: "--bad", dash: [6, 4] });
          data.push(t.map(() => objectives[id]));
        }
        chart(`${id}/latency`, card.querySelector('[data-chart="latency"]'), latency, data, "s");
      }
    }
    for (const card of [...box.children]) {
      if (!seen.has(card.dataset.model)) card.remove();
    }
    if (!ids.size) {
      clear(box);
      box.append(el("p", { class: "summary", text: "No model is served or announced." }));
    }
  }

  // -- Node ------------------------------------------------------------------------------------

  function kvList(pairs) {
    const dl = el("dl", { class: "kv" });
    for (const [k, v] of pairs) dl.append(el("dt", { text: k }), el("dd", { text: v }));
    return dl;
  }

  async function renderNode(mine, sid) {
    const box = $("node-detail");
    if (!sid) {
      $("node-hint").hidden = false;
      clear(box);
      return;
    }
    $("node-hint").hidden = true;
    const id = encodeURIComponent(sid);
    const [n, history, engine] = await Promise.all([
      getJson(`/fabric/v1/nodes/${id}`),
      getJson(`/fabric/v1/nodes/${id}/load`),
      // Asked of the node's own agent through this one: only once per node shown.
      engineOf.has(sid) ? engineOf.get(sid) : getJson(`/fabric/v1/nodes/${id}/engine`),
    ]);
    if (engine.command) engineOf.set(sid, engine);
    if (mine !== generation) return;
    let chartBox = box.querySelector('[data-chart="load"]');
    const head = el(
      "div",
      { dataset: { node: n.session_id } },
      el("h2", {}, el("span", { class: "mono", text: n.session_id }), " ",
        el("span", { class: `state state-${n.state}`, text: n.state }), " · ",
        el("span", { class: `live live-${n.liveness}`, text: n.liveness })),
      kvList([
        ["provider", n.provider + (n.verified_provider ? ` (verified ${n.verified_provider})` : " (unverified)")],
        ["site", siteOf(n)],
        ["entry version", String(n.version)],
        ["host", (n.hardware && n.hardware.host) || "–"],
        ["GPUs", `${gpus(n.hardware)}${n.hardware && n.hardware.gpu_memory_gb ? `, ${n.hardware.gpu_memory_gb} GB each` : ""}`],
        ["engine", n.engine && n.engine.kind ? `${n.engine.kind} ${n.engine.version || "(version unknown)"}` : "none"],
        ["engine URL", (n.engine && n.engine.url) || "–"],
        ["engine command", engine.command ? engine.command.join(" ") : `unknown (${engine.reason || "not said"})`],
        ["models", (n.models || []).map((m) => m.id + (m.max_model_len ? ` (${m.max_model_len} tokens)` : "") + (m.parent ? ` on ${m.parent}` : "")).join(", ") || "–"],
        ["addresses", `http ${n.addresses.http || "–"} · gossip ${n.addresses.gossip || "–"}`],
        ["labels", Object.entries(n.labels || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "–"],
        ["load", n.load ? `KV ${fmt.pct(n.load.kv_usage)} · ${n.load.running} running · ${n.load.waiting} waiting · ${n.load.inflight} in flight (${fmt.age(n.load.updated_at)})` : "no report"],
        ["started", `${fmt.time(n.started_at)} (${fmt.age(n.started_at)})`],
        ["entry expires", fmt.time(n.expires_at)],
      ]),
      el("h3", { text: "Recent load" }),
    );
    if (!chartBox) chartBox = el("div", { class: "chart", dataset: { chart: "load" } });
    clear(box);
    box.append(head, chartBox);
    const samples = history.samples || [];
    if (samples.length) {
      chart(`node/${n.session_id}`, chartBox,
        [{ label: "KV %" }, { label: "running", color: "--ok" }, { label: "waiting", color: "--warn" }],
        [samples.map((x) => x.at), samples.map((x) => x.kv_usage * 100), samples.map((x) => x.running), samples.map((x) => x.waiting)],
        "");
    } else {
      chartBox.textContent = "No load report yet.";
    }
  }

  // -- Controller ------------------------------------------------------------------------------

  async function renderController(mine) {
    const fleet = await getJson("/fabric/v1/fleet");
    if (mine !== generation) return;
    const box = $("controller-detail");
    clear(box);
    const ctl = fleet.controller;
    const services = fleet.services;
    $("controller-summary").textContent = services
      ? `Service file ${String(services.digest || "").slice(0, 12)} by ${services.operator || "?"}, issued ${fmt.time(services.issued_at)}.`
      : "No service file is applied (fabric services apply FILE).";
    if (!ctl) {
      box.append(el("p", { text: fleet.acting
        ? `The acting controller (${fmt.short(fleet.acting.session_id)}) did not answer.`
        : "No controller runs in this mesh (fabric start --controller)." }));
      return;
    }
    box.append(kvList([
      ["acting controller", fleet.acting ? fleet.acting.session_id : "–"],
      ["role of the one asked", ctl.role],
      ["last pass", fmt.time(ctl.last_pass_at)],
      ["dry run", ctl.dry_run ? "yes" : "no"],
      ["error", ctl.error || "none"],
    ]));
    const rows = (ctl.models || []).map((m) => el(
      "tr",
      { dataset: { model: m.model } },
      el("td", { text: m.model }),
      el("td", { class: "num", text: String(m.target) }),
      el("td", { class: "num", text: String(m.serving) }),
      el("td", { class: "num", text: String(m.starting) }),
      el("td", { class: "num", text: String(m.pending) }),
      el("td", { class: "num", text: String(m.draining) }),
      el("td", { text: m.state }),
      el("td", { text: [m.reason, m.note].filter(Boolean).join("; ") || "–" }),
    ));
    box.append(
      el("h2", { text: "Desired and actual" }),
      el("div", { class: "group" }, el("table", {},
        el("thead", {}, el("tr", {}, ...["Model", "Target", "Serving", "Starting", "Pending", "Draining", "State", "Why"].map(
          (h, i) => el("th", { class: i > 0 && i < 6 ? "num" : undefined, text: h })))),
        el("tbody", {}, ...rows))),
    );
    const decisions = (ctl.decisions || []).slice().reverse();
    box.append(
      el("h2", { text: "Decisions" }),
      decisions.length
        ? el("div", { class: "group" }, el("table", {},
          el("thead", {}, el("tr", {}, ...["When", "Model", "Action", "Job", "Reason"].map((h) => el("th", { text: h })))),
          el("tbody", {}, ...decisions.map((d) => el("tr", {},
            el("td", { text: fmt.time(d.at) }),
            el("td", { text: d.model || "–" }),
            el("td", { text: d.action }),
            el("td", { class: "mono", text: d.job_id || "–" }),
            el("td", { text: d.reason })))))
        )
        : el("p", { class: "summary", text: "No decision yet." }),
    );
  }

  // -- Playground ------------------------------------------------------------------------------

  async function loadModels() {
    await refreshSession();
    if (!mayChat()) return;
    try {
      const doc = await getJson("/v1/models");
      const select = $("chat-model");
      const chosen = select.value;
      clear(select);
      for (const m of doc.data || []) select.append(el("option", { value: m.id, text: m.id }));
      if (chosen) select.value = chosen;
      updated();
    } catch (err) {
      failed(err);
    }
  }

  async function send(event) {
    event.preventDefault();
    if (chat) return;
    const out = $("chat-output");
    const meta = $("chat-meta");
    out.textContent = "";
    meta.textContent = "sending…";
    delete meta.dataset.done; // set again when this answer is whole
    const body = {
      model: $("chat-model").value,
      messages: [{ role: "user", content: $("chat-input").value }],
      max_tokens: Number($("chat-max").value) || 128,
      stream: true,
      stream_options: { include_usage: true },
    };
    chat = new AbortController();
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    const started = performance.now();
    let first = 0;
    let tokens = 0;
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: chat.signal,
      });
      const node = response.headers.get("X-Fabric-Node") || "";
      const served = () => el("a", { href: `#/node/${encodeURIComponent(node)}`, class: "mono", title: node, text: fmt.short(node) || "?" });
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) {
              if (!first) first = performance.now();
              out.append(document.createTextNode(delta.content));
            }
            if (chunk.usage) tokens = chunk.usage.completion_tokens;
          }
        }
        clear(meta);
        meta.append("served by ", served(), first ? ` · first token after ${fmt.secs((first - started) / 1000)}` : " · waiting for the first token");
      }
      clear(meta);
      meta.append("served by ", served(),
        ` · first token after ${fmt.secs(((first || performance.now()) - started) / 1000)}` +
        ` · ${tokens || "?"} tokens in ${fmt.secs((performance.now() - started) / 1000)}`);
      meta.dataset.done = "1";
    } catch (err) {
      meta.textContent = err.name === "AbortError" ? "stopped" : `failed: ${err.message}`;
    } finally {
      chat = null;
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
    }
  }

  const renderers = {
    mesh: renderMesh,
    models: renderModels,
    node: renderNode,
    controller: renderController,
    playground: async () => {},
  };

  // -- wiring ----------------------------------------------------------------------------------

  function wire() {
    window.addEventListener("hashchange", show);
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && current.view !== "playground") poll();
    });
    window.addEventListener("resize", resizeCharts);
    let debounce = 0;
    const filters = $("mesh-filters");
    filters.addEventListener("input", () => {
      window.clearTimeout(debounce);
      debounce = window.setTimeout(poll, 300);
    });
    filters.addEventListener("submit", (e) => e.preventDefault());
    $("key-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      const key = $("key-input").value.trim();
      if (key) sessionStorage.setItem(KEY_STORE, key);
      $("key-input").value = "";
      await refreshSession();
      show();
    });
    $("key-forget").addEventListener("click", async () => {
      sessionStorage.removeItem(KEY_STORE);
      await refreshSession();
      show();
    });
    $("key-button").addEventListener("click", () => {
      $("key-form").hidden = false;
      $("key-input").focus();
    });
    $("chat-form").addEventListener("submit", send);
    $("chat-stop").addEventListener("click", () => chat && chat.abort());
  }

  wire();
  refreshSession().then(show, (err) => {
    failed(err);
    show();
  });
})();

// treeopsd view: the tree list (filters, sorting, pages, keyboard) and the glue to tree.js. Data comes from
// the server's /api/… routes, or, in a static export, from window.TREEOPSD_EXPORT (static/data.js).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const EXPORT = window.TREEOPSD_EXPORT || null;
  const PAGE = 50;
  const state = { offset: 0, tree: null, turn: null, mode: "behaviour", poll: null, total: 0 };
  const fmt = (x, d) => window.TreeView.fmt(x, d);

  function params() {
    const f = new FormData($("filters")), p = new URLSearchParams();
    for (const k of ["no_signal", "truncated", "credited"]) if (f.get(k)) p.set(k, "1");
    for (const k of ["mismatch_min", "q", "sort"]) if (f.get(k)) p.set(k, f.get(k));
    p.set("desc", f.get("asc") ? "0" : "1"); p.set("offset", state.offset); p.set("limit", PAGE);
    return p;
  }

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin" });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || r.statusText);
    return body;
  }

  function exportPage(p) {  // the export's list, filtered and sorted here like the server does
    let rows = EXPORT.rows.filter((r) => (!p.get("no_signal") || r.no_signal) && (!p.get("truncated") || r.truncated)
      && (!p.get("credited") || r.credited) && (!p.get("mismatch_min") || (r.mismatch ?? -1) >= Number(p.get("mismatch_min")))
      && (!p.get("q") || (r.id + " " + r.task).toLowerCase().includes(p.get("q").toLowerCase())));
    const key = { newest: (r) => r.first_seq, step: (r) => r.step ?? 1e12, task: (r) => r.task, size: (r) => r.nodes,
      leaves: (r) => r.leaves, spread: (r) => (r.r_max ?? 0) - (r.r_min ?? 0), mismatch: (r) => r.mismatch ?? -1 }[p.get("sort") || "newest"];
    rows.sort((a, b) => (key(a) < key(b) ? -1 : key(a) > key(b) ? 1 : 0) * (p.get("desc") === "1" ? -1 : 1));
    const o = Number(p.get("offset"));
    return { rows: rows.slice(o, o + PAGE), total: rows.length, offset: o, complete: true, problems: [],
      segments: { indexed: 0, total: 0 } };
  }

  function cell(tr, text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; tr.append(td); }

  function renderRows(page) {
    const body = $("tree-rows"); body.replaceChildren();
    for (const r of page.rows) {
      const tr = document.createElement("tr");
      tr.tabIndex = -1; tr.dataset.treeId = r.id; tr.setAttribute("aria-selected", r.id === state.tree ? "true" : "false");
      cell(tr, r.id); cell(tr, r.step ?? r.state, "num"); cell(tr, r.task); cell(tr, r.leaves, "num");
      cell(tr, r.r_min === null ? "—" : `${fmt(r.r_min, 2)}–${fmt(r.r_max, 2)}`, "num"); cell(tr, fmt(r.r_sd, 2), "num");
      cell(tr, r.nodes, "num"); cell(tr, r.tokens, "num"); cell(tr, r.mismatch === null ? "—" : r.mismatch.toExponential(1), "num");
      const flags = document.createElement("td");
      for (const [on, name] of [[r.no_signal, "no signal"], [r.truncated, "cut"], [!r.credited, "raw"]]) {
        if (on) { const s = document.createElement("span"); s.className = "flag"; s.textContent = name; flags.append(s); }
      }
      tr.append(flags);
      tr.addEventListener("click", () => openTree(r.id));
      tr.addEventListener("keydown", rowKey);
      body.append(tr);
    }
    const first = body.querySelector('tr[aria-selected="true"]') || body.firstElementChild;
    if (first) first.tabIndex = 0;
  }

  function rowKey(e) {
    const tr = e.currentTarget, to = { ArrowDown: tr.nextElementSibling, ArrowUp: tr.previousElementSibling }[e.key];
    if (to) { tr.tabIndex = -1; to.tabIndex = 0; to.focus(); e.preventDefault(); }
    if (e.key === "Enter" || e.key === " ") { openTree(tr.dataset.treeId); e.preventDefault(); }
  }

  async function loadList() {
    clearTimeout(state.poll);
    const p = params();
    let page;
    try { page = EXPORT ? exportPage(p) : await getJSON("api/trees?" + p); }
    catch (err) { $("status").textContent = "list: " + err.message; return; }
    state.total = page.total;
    renderRows(page);
    const end = Math.min(page.offset + page.rows.length, page.total);
    $("page-line").textContent = page.total ? `${page.offset + 1}–${end} of ${page.total}${page.complete ? "" : "+"}` : "no trees";
    $("prev").disabled = page.offset === 0; $("next").disabled = end >= page.total && page.complete;
    $("status").textContent = page.complete ? `${page.total} tree${page.total === 1 ? "" : "s"}` + (EXPORT ? " in this export" : "")
      : `indexing the store: ${page.segments.indexed} of ${page.segments.total} segments read…`;
    const probs = $("problems"); probs.replaceChildren();
    for (const line of page.problems) { const li = document.createElement("li"); li.textContent = line; probs.append(li); }
    if (!page.complete) state.poll = setTimeout(loadList, 700);
  }

  async function openTree(id, turn) {
    state.tree = id; state.turn = null;
    for (const tr of $("tree-rows").children) tr.setAttribute("aria-selected", tr.dataset.treeId === id ? "true" : "false");
    $("tree-title").textContent = "Tree " + id;
    let d;
    try { d = EXPORT ? EXPORT.trees[id] : await getJSON("api/tree/" + encodeURIComponent(id)); }
    catch (err) { d = { id, error: err.message }; }
    if (!d) d = { id, error: "this tree is not in the export" };
    state.detail = d;
    const err = $("tree-error"), svg = $("tree-svg");
    $("tree-notes").replaceChildren(...(d.notes || []).map((t) => Object.assign(document.createElement("li"), { textContent: t })));
    if (d.error) {
      err.textContent = d.error; err.hidden = false; $("tree-box").hidden = true; $("legend").hidden = true;
      $("turn-pane").hidden = true; $("tree-facts").textContent = ""; return;
    }
    err.hidden = true;
    const turns = d.nodes.length - 1;
    $("tree-facts").replaceChildren(...[["nodes", d.nodes.length], ["turns", turns], ["leaves", d.leaves.length],
      ["branch points", d.branch_points.length], ["step", d.step ?? "not trained yet"], ["credit", d.credit_source],
      ["τ", fmt(d.tau, 3)], ["learner record", d.learner_record ? "yes" : "no"]].map(([k, v]) => {
      const s = document.createElement("span"); s.dataset.testid = "facts-" + k.split(" ")[0]; s.dataset.value = v;
      s.textContent = `${k} ${v} · `; return s;
    }));
    window.TreeView.draw(d, svg, selectTurn);
    window.TreeView.legend($("legend"), d);
    selectTurn(turn ?? (d.nodes[0].children[0] ?? 0), false);
    history.replaceState(null, "", "#tree=" + encodeURIComponent(id));
  }

  function selectTurn(id, focus = true) {
    state.turn = id;
    const svg = $("tree-svg");
    if (focus) { const g = svg.querySelector(`g.node[data-node-id="${id}"]`); if (g) g.focus(); }
    window.TreeView.select(svg, id);
    window.TreeView.turn(state.detail, id, state.mode);
  }

  async function loadRun() {
    const run = EXPORT ? EXPORT.run : await getJSON("api/run");
    $("run-name").textContent = run.name + (run.method ? ` · ${run.method}` : "") + (run.rho ? ` · ρ ${run.rho}` : "");
    const lines = [run.run_dir, run.writer, run.store_problem, ...(run.notes || [])].filter(Boolean);
    $("run-line").textContent = lines.join(" · ");
  }

  function wire() {
    $("filters").addEventListener("input", () => { state.offset = 0; loadList(); });
    $("filters").addEventListener("submit", (e) => e.preventDefault());
    $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); loadList(); });
    $("next").addEventListener("click", () => { state.offset += PAGE; loadList(); });
    $("heat-mode").addEventListener("change", (e) => { state.mode = e.target.value; if (state.turn !== null) selectTurn(state.turn, false); });
    document.addEventListener("keydown", (e) => {
      if (e.key === "/" && !["INPUT", "SELECT"].includes(document.activeElement.tagName)) { e.preventDefault(); $("filters").q.focus(); }
    });
  }

  async function main() {
    wire();
    try { await loadRun(); } catch (err) { $("run-line").textContent = "run: " + err.message; }
    await loadList();
    const m = location.hash.match(/tree=([^&]+)/);
    const first = m ? decodeURIComponent(m[1]) : (EXPORT && EXPORT.rows.length ? EXPORT.rows[0].id : null);
    if (first) openTree(first);
  }
  main();
})();

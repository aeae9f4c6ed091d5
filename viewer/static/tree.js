// treeopsd view: one rollout tree drawn as SVG (a layered layout: leaves side by side in depth-first order,
// a parent centred over its children, one row per depth), and the selected turn's panel. No library: the
// layout is the few lines below. Colours: cividis (rewards), viridis (log-probs), blue–orange (gaps).
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const CIVIDIS = ["#00204d", "#31446b", "#666970", "#958f78", "#cbba69", "#ffea46"];
  const VIRIDIS = ["#440154", "#414487", "#2a788e", "#22a884", "#7ad151", "#fde725"];
  const DIVERGING = ["#2166ac", "#92c5de", "#f7f7f7", "#fdb863", "#b35806"];
  const CUT = new Set(["truncated", "max_turns"]);

  function hex(c) { return [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16)); }
  function ramp(stops, t) {
    t = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0));
    const x = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    const a = hex(stops[i]), b = hex(stops[i + 1]);
    return "#" + a.map((v, k) => Math.round(v + (b[k] - v) * f).toString(16).padStart(2, "0")).join("");
  }
  function ink(bg) {  // black or white text, whichever contrasts more with the background
    const [r, g, b] = hex(bg).map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.179 ? "#000" : "#fff";
  }
  function fmt(x, d = 3) { return x === null || x === undefined ? "—" : Number(x).toFixed(d); }
  function el(tag, attrs, text) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function rewardDomain(detail) {
    const r = detail.leaves.map((i) => detail.nodes[i].reward).filter((x) => x !== null);
    return [Math.min(0, ...r), Math.max(1, ...r)];
  }

  function layout(detail) {  // x in leaf slots, y = depth
    const pos = {}; let next = 0;
    (function place(i) {
      const kids = detail.nodes[i].children;
      if (!kids.length) { pos[i] = next++; return; }
      kids.forEach(place);
      pos[i] = (pos[kids[0]] + pos[kids[kids.length - 1]]) / 2;
    })(0);
    return { x: pos, slots: Math.max(next, 1), depth: Math.max(...detail.nodes.map((n) => n.depth)) };
  }

  function draw(detail, svg, onSelect) {
    svg.replaceChildren();
    const L = layout(detail), dx = 56, dy = 74, pad = 30;
    const w = Math.max(L.slots * dx + 2 * pad, 320), h = (L.depth + 1) * dy + 2 * pad;
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`); svg.setAttribute("width", w); svg.setAttribute("height", h);
    const at = (i) => [pad + L.x[i] * dx + dx / 2, pad + detail.nodes[i].depth * dy];
    const [lo, hi] = rewardDomain(detail), branch = new Set(detail.branch_points);
    for (const n of detail.nodes.slice(1)) {
      const [x1, y1] = at(n.parent), [x2, y2] = at(n.id), ym = (y1 + y2) / 2;
      svg.append(el("svg:path", { class: "edge", d: `M${x1},${y1} C${x1},${ym} ${x2},${ym} ${x2},${y2}` }));
    }
    for (const n of detail.nodes) {
      const [x, y] = at(n.id), leaf = !n.children.length && n.id > 0, cut = CUT.has(detail.finish[String(n.id)]);
      const g = el("svg:g", { class: "node" + (leaf ? " leaf" : "") + (branch.has(n.id) ? " branch" : ""),
        role: "treeitem", tabindex: n.id === 0 ? "0" : "-1", "data-node-id": n.id, "aria-level": n.depth + 1,
        "aria-selected": "false", transform: `translate(${x},${y})`, "aria-label": label(n, detail, leaf, cut) });
      const fill = leaf && n.reward !== null ? ramp(CIVIDIS, (n.reward - lo) / (hi - lo || 1)) : n.id === 0 ? "#e8e8e8" : "#fafafa";
      const mark = n.id === 0 ? el("svg:rect", { x: -14, y: -14, width: 28, height: 28, rx: 4 })
        : branch.has(n.id) ? el("svg:path", { d: "M0,-17 L17,0 L0,17 L-17,0 Z" })
        : el("svg:circle", { r: 14 });
      mark.setAttribute("class", "mark"); mark.setAttribute("fill", fill);
      mark.setAttribute("stroke", "#333"); mark.setAttribute("stroke-width", leaf ? "2" : "1.5");
      if (cut) mark.setAttribute("stroke-dasharray", "4 3");
      g.append(mark, el("svg:text", { "text-anchor": "middle", dy: "4", fill: ink(fill) }, n.id === 0 ? "P" : String(n.id)));
      if (leaf) g.append(el("svg:text", { "text-anchor": "middle", y: 30 }, (cut ? "✂ " : "") + fmt(n.reward, 2)));
      g.addEventListener("click", () => onSelect(n.id));
      g.addEventListener("keydown", (e) => key(e, detail, n.id, onSelect));
      svg.append(g);
    }
    svg.parentElement.hidden = false;
  }

  function label(n, detail, leaf, cut) {
    if (n.id === 0) return `prompt, ${n.children.length} first turns`;
    const what = leaf ? `leaf, reward ${fmt(n.reward, 2)}${cut ? ", cut: " + detail.finish[String(n.id)] : ""}`
      : `${n.children.length} children`;
    return `turn ${n.id}, depth ${n.depth}, ${what}, V ${fmt(n.V)}, q ${fmt(n.q)}`;
  }

  function key(e, detail, id, onSelect) {  // ↑ parent, ↓ first child, ←/→ siblings, Home the prompt
    const n = detail.nodes[id], sibs = n.parent >= 0 ? detail.nodes[n.parent].children : [0];
    const k = sibs.indexOf(id);
    const to = { ArrowUp: n.parent, ArrowDown: n.children[0], ArrowLeft: sibs[k - 1], ArrowRight: sibs[k + 1],
      Home: 0 }[e.key];
    if (e.key === "Enter" || e.key === " ") { onSelect(id); e.preventDefault(); return; }
    if (to === undefined || to < 0) return;
    e.preventDefault(); onSelect(to);
  }

  function select(svg, id) {
    for (const g of svg.querySelectorAll("g.node")) {
      const on = g.dataset.nodeId === String(id);
      g.setAttribute("aria-selected", on ? "true" : "false"); g.setAttribute("tabindex", on ? "0" : "-1");
      if (on && document.activeElement !== g && svg.contains(document.activeElement)) g.focus();
    }
  }

  function legend(box, detail) {
    const [lo, hi] = rewardDomain(detail);
    box.replaceChildren(el("span", {}, "leaf reward"));
    for (let k = 0; k <= 4; k++) {
      const v = lo + (hi - lo) * k / 4, s = el("span", { class: "swatch", title: fmt(v, 2) });
      s.style.background = ramp(CIVIDIS, k / 4); box.append(s, el("span", {}, fmt(v, 2)));
    }
    box.append(el("span", {}, "· ◆ branch point · ▢ prompt · dashed ✂ cut by the token or turn limit"));
    box.hidden = false;
  }

  function heatScale(mode) {
    if (mode === "gap") return { stops: DIVERGING, t: (v) => (v + 1) / 2, lo: "−1", hi: "+1" };
    return { stops: VIRIDIS, t: (v) => (v + 10) / 10, lo: "≤ −10", hi: "0" };
  }

  function tokens(box, legendBox, node, mode) {
    box.replaceChildren(); legendBox.replaceChildren();
    const sc = heatScale(mode), vals = node.tokens.map((_, i) => {
      const b = node.behaviour_lp[i], l = node.learner_lp ? node.learner_lp[i] : null;
      return mode === "behaviour" ? b : mode === "learner" ? l : (l === null || b === null ? null : l - b);
    });
    legendBox.append(el("span", {}, sc.lo));
    for (let k = 0; k <= 5; k++) { const s = el("span", { class: "swatch" }); s.style.background = ramp(sc.stops, k / 5); legendBox.append(s); }
    legendBox.append(el("span", {}, sc.hi + (mode !== "behaviour" && !node.learner_lp ? " · no learner record for this turn" : "")));
    node.tokens.forEach((t, i) => {
      const piece = node.pieces && node.pieces[i] !== undefined ? node.pieces[i] : `⟨${t}⟩`;
      const s = el("span", { class: "tok" + (node.mask[i] ? "" : " off"), "data-token-id": t,
        title: `token ${t} · μ ${fmt(node.behaviour_lp[i])} · π_θ ${fmt(node.learner_lp ? node.learner_lp[i] : null)}` +
          (node.mask[i] ? "" : " · not in the loss") }, piece);
      if (vals[i] !== null) { const bg = ramp(sc.stops, sc.t(vals[i])); s.style.background = bg; s.style.color = ink(bg); }
      box.append(s);
    });
  }

  function values(dl, node, detail) {
    const st = node.student || {}, learned = st.source === "learner";
    const rows = [["V", node.V, 4], ["q", node.q, 4], ["z", node.z, 4], ["reward", node.reward, 3],
      ["p = σ(s)", st.p, 4], ["s", st.s, 4], [learned ? "loss share" : "ℓ·KL at μ", learned ? st.loss : st.ell_kl, 5],
      ["KL(q‖p)", st.kl, 5], ["ℓ (loss tokens)", node.ell, 0], ["version", node.version, 0],
      ["τ", detail.tau, 3], [learned ? "Z (mini-batch)" : "student", learned ? st.Z : "at θ = μ, untrained", 0]];
    dl.replaceChildren();
    for (const [name, v, d] of rows) {
      const dd = el("dd", { "data-testid": "turn-" + name.split(" ")[0], "data-value": v === null || v === undefined ? "" : String(v) },
        typeof v === "string" ? v : fmt(v, d));
      dl.append(el("dt", {}, name), dd);
    }
  }

  function turn(detail, id, mode) {
    const node = detail.nodes[id], $ = (x) => document.getElementById(x);
    $("turn-pane").hidden = false;
    $("turn-title").textContent = id === 0 ? "The prompt" : `Turn ${id} (depth ${node.depth}` +
      (node.children.length ? `, ${node.children.length} children)` : `, leaf: ${detail.finish[String(id)] || "end"})`);
    values($("turn-values"), node, detail);
    $("turn-text").textContent = id === 0 ? "(the prompt is the observation below)" : node.text ?? node.tokens.join(" ");
    $("turn-call").textContent = node.call ? JSON.stringify(node.call, null, 1) : "—";
    $("turn-obs").textContent = node.obs_text || (node.obs_tokens ? `${node.obs_tokens} tokens` : "—");
    tokens($("turn-tokens"), $("heat-legend"), node, mode);
  }

  window.TreeView = { draw, select, legend, turn, fmt, ramp, CIVIDIS };
})();

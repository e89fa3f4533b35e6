"""The run dashboard's style and script (:mod:`rlhf_core.tracking.run_dashboard` inlines them into the page).

Plain JavaScript drawing inline SVG, no library and nothing fetched. The script reads the JSON block
``#run-data`` and builds the panels; each has an ``id`` (``panel-metrics``, ``panel-timeline``,
``panel-staleness``, ``panel-distributions``, ``panel-mismatch``, ``panel-samples``) and the metric cells carry
``data-step`` and ``data-metric``, so a browser test finds them. Clicking a sample in the drill-down list shows
it in ``#sample-detail``, with one row per response token (``.token-row``).
"""

PAGE_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1200px}
h1{font-size:1.4em;margin-bottom:0}.sub{color:#666;margin-top:.2em}
section{border-top:1px solid #ccc;margin-top:1.2em;padding-top:.4em}h2{font-size:1.1em}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}
th{background:#f4f4f4}.scroll{max-height:320px;overflow:auto;display:inline-block}
svg{background:#fcfcfc;border:1px solid #eee}svg text{font-size:10px;fill:#444}
.legend span{display:inline-block;margin-right:1em;font-size:.85em}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
.sample-list button{margin:2px;font-size:.8em;cursor:pointer}
.seg-policy{background:#eef5ff}.seg-observation{background:#fff4dd;font-style:italic}
pre{white-space:pre-wrap;word-break:break-word;border:1px solid #eee;padding:4px;font-size:.85em}
.token-row td:first-child{text-align:left;font-family:monospace}.note{color:#666;font-size:.85em}
"""

PAGE_SCRIPT = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("run-data").textContent);
const COLORS = {"rollout":"#4e79a7","reward":"#f28e2b","log-probs":"#59a14f","update":"#e15759","sync":"#b07aa1",
  "idle":"#dddddd"};
const PALETTE = ["#4e79a7","#f28e2b","#e15759","#76b7b2","#59a14f","#edc948","#b07aa1"];
const app = document.getElementById("app");

function el(tag, attrs, ...kids) {
  const svgTags = ["svg","rect","line","polyline","polygon","text","circle","g","title"];
  const node = svgTags.includes(tag) ? document.createElementNS("http://www.w3.org/2000/svg", tag)
                                     : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const kid of kids) node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  return node;
}
function section(id, title, note) {
  const s = el("section", {id: id}, el("h2", {}, title));
  if (note) s.append(el("p", {class: "note"}, note));
  app.append(s);
  return s;
}
function fmt(v) { return (v === null || v === undefined) ? "\u2013" : String(v); }
function short(v) { return (v === null || v === undefined) ? "\u2013" : Number(v).toPrecision(4); }
function legend(names, colors) {
  return el("div", {class: "legend"}, ...names.map((n, i) => el("span", {}, el("i", {style:
    "background:" + (colors[n] || PALETTE[i % PALETTE.length])}), n)));
}

// A chart over steps: lines [{name, pts:[[x,y]]}] and bands [{pts:[[x,lo,hi]], color}]
function chart(lines, bands, opts) {
  const W = 560, H = 180, L = 56, B = 22, T = 8, R = 8;
  const xs = [], ys = [];
  for (const l of lines) for (const p of l.pts) { xs.push(p[0]); ys.push(p[1]); }
  for (const b of bands) for (const p of b.pts) { xs.push(p[0]); ys.push(p[1], p[2]); }
  const svg = el("svg", {width: W, height: H, class: "chart"});
  if (!xs.length) { svg.append(el("text", {x: 20, y: 40}, "no data")); return svg; }
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - B - T);
  svg.append(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}),
             el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}),
             el("text", {x: 2, y: T + 8}, short(y1)), el("text", {x: 2, y: H - B}, short(y0)),
             el("text", {x: L, y: H - 6}, "step " + x0), el("text", {x: W - R - 50, y: H - 6}, "step " + x1));
  for (const b of bands) {
    const up = b.pts.map(p => sx(p[0]) + "," + sy(p[2])), down = b.pts.slice().reverse().map(p => sx(p[0]) + "," + sy(p[1]));
    svg.append(el("polygon", {points: up.concat(down).join(" "), fill: b.color, "fill-opacity": b.opacity || 0.25}));
  }
  lines.forEach((l, i) => {
    const color = l.color || PALETTE[i % PALETTE.length];
    svg.append(el("polyline", {points: l.pts.map(p => sx(p[0]) + "," + sy(p[1])).join(" "), fill: "none",
                               stroke: color, "stroke-width": 1.5}));
    for (const p of l.pts) svg.append(el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2, fill: color},
                                         el("title", {}, l.name + " @ step " + p[0] + ": " + p[1])));
  });
  return svg;
}

function metricsPanel() {
  const s = section("panel-metrics", "Logged metrics per step", "The values the run logged, as logged.");
  const head = el("tr", {}, el("th", {}, "step"), ...DATA.columns.map(c => el("th", {}, c)));
  const rows = DATA.steps.map(st => el("tr", {}, el("td", {}, st.step), ...DATA.columns.map(c =>
    el("td", {"data-step": st.step, "data-metric": c}, fmt(st.metrics[c])))));
  s.append(el("div", {class: "scroll"}, el("table", {id: "metrics-table"}, head, ...rows)));
}

function timelineSvg(st) {
  const names = Object.keys(st.lanes).sort();
  const end = Math.max(0.001, ...names.flatMap(n => st.lanes[n].spans.map(sp => sp[2])));
  const W = 900, L = 230, RH = 26, H = 20 + RH * names.length;
  const svg = el("svg", {width: W, height: H, id: "timeline-svg"});
  const sx = t => L + t / end * (W - L - 10);
  names.forEach((name, i) => {
    const lane = st.lanes[name], y = 10 + i * RH;
    svg.append(el("text", {x: 2, y: y + 14}, name + " (idle " + lane.idle.toFixed(3) + " s)"));
    svg.append(el("rect", {x: sx(0), y: y + 9, width: sx(end) - sx(0), height: 2, fill: COLORS.idle}));
    for (const [phase, a, b] of lane.spans) {
      svg.append(el("rect", {x: sx(a), y: y, width: Math.max(1, sx(b) - sx(a)), height: 20, fill: COLORS[phase] || "#888",
                             class: "phase", "data-phase": phase},
                    el("title", {}, phase + ": " + (b - a).toFixed(4) + " s (from " + a.toFixed(4) + " s)")));
    }
  });
  return svg;
}

function timelinePanel() {
  const s = section("panel-timeline", "Phase timeline",
    "One lane per process on CPU, per device on a GPU (a lane per thread: the trainer's, the rollout thread's); " +
    "time from the step's first phase; the grey line is idle time between phases.");
  const pick = el("select", {id: "timeline-step"}, ...DATA.steps.map(st => el("option", {value: st.step}, "step " + st.step)));
  const holder = el("div", {});
  const table = el("table", {id: "lane-table"});
  const show = () => {
    const st = DATA.steps.find(x => String(x.step) === pick.value);
    holder.replaceChildren(timelineSvg(st));
    table.replaceChildren(el("tr", {}, el("th", {}, "lane"), el("th", {}, "busy s"), el("th", {}, "idle s")),
      ...Object.keys(st.lanes).sort().map(n => el("tr", {}, el("td", {}, n), el("td", {}, st.lanes[n].busy.toFixed(4)),
                                                    el("td", {}, st.lanes[n].idle.toFixed(4)))));
  };
  pick.addEventListener("change", show);
  if (DATA.steps.length) { pick.value = String(DATA.steps[DATA.steps.length - 1].step); show(); }
  s.append(pick, legend(DATA.phases.concat(["idle"]), COLORS), holder, table);
  const totals = DATA.phases.map((ph, i) => ({name: ph, color: COLORS[ph], pts: DATA.steps.map(st =>
    [st.step, Object.values(st.lanes).reduce((acc, l) => acc + l.spans.filter(x => x[0] === ph)
      .reduce((a, x) => a + x[2] - x[1], 0), 0)])})).filter(l => l.pts.some(p => p[1] > 0));
  s.append(el("h3", {}, "Seconds per phase over steps"), chart(totals, [], {}));
}

function stalenessPanel() {
  const s = section("panel-staleness", "Staleness per sample",
    "Samples per step by how many updates older than the updated policy their generating policy was (0: on-policy).");
  const ks = [...new Set(DATA.steps.flatMap(st => Object.keys(st.staleness)))].sort((a, b) => a - b);
  const head = el("tr", {}, el("th", {}, "step"), ...ks.map(k => el("th", {}, "staleness " + k)));
  const rows = DATA.steps.map(st => el("tr", {}, el("td", {}, st.step),
    ...ks.map(k => el("td", {"data-step": st.step, "data-staleness": k}, st.staleness[k] || 0))));
  s.append(el("div", {class: "scroll"}, el("table", {id: "staleness-table"}, head, ...rows)));
}

function distributionsPanel() {
  const s = section("panel-distributions", "Distributions over steps",
    "Per sample: band p10-p90 (light), p25-p75 (dark), median (line). kl: summed k3 KL(pi_old || pi_ref) of " +
    "the sample; entropy: the mean negative log-prob of its sampled tokens under the engine (an entropy estimate).");
  for (const name of ["reward", "length", "kl", "entropy"]) {
    const pts = DATA.steps.filter(st => st.dist[name]).map(st => [st.step, st.dist[name]]);
    const outer = {pts: pts.map(([x, d]) => [x, d.q[1], d.q[5]]), color: "#4e79a7", opacity: 0.18};
    const inner = {pts: pts.map(([x, d]) => [x, d.q[2], d.q[4]]), color: "#4e79a7", opacity: 0.35};
    const med = {name: name + " median", pts: pts.map(([x, d]) => [x, d.q[3]]), color: "#1b3a5c"};
    s.append(el("div", {class: "dist", "data-dist": name}, el("h3", {}, name), chart([med], [outer, inner], {})));
  }
}

function mismatchPanel() {
  const s = section("panel-mismatch", "Train-inference mismatch",
    "rollout/logprob_mismatch: mean |engine - trainer| log-prob per token (logged). mismatch KL: mean k3 " +
    "estimate of KL(engine || trainer) per token over the batch, where pi_old is recomputed before the update.");
  const logged = {name: "rollout/logprob_mismatch", pts: DATA.steps.filter(st => st.metrics["rollout/logprob_mismatch"] != null)
    .map(st => [st.step, st.metrics["rollout/logprob_mismatch"]])};
  const kl = {name: "mismatch KL", pts: DATA.steps.filter(st => st.mismatch_kl != null).map(st => [st.step, st.mismatch_kl])};
  s.append(legend([logged.name, kl.name], {}), chart([logged, kl], [], {}));
}

function sampleDetail(st, smp) {
  const box = document.getElementById("sample-detail");
  const segs = el("pre", {class: "completion"}, ...(smp.segments || []).map(sg =>
    el("span", {class: "seg-" + sg.source}, sg.text)));
  const rows = smp.tokens.map((t, i) => {
    const e = smp.engine_logp[i], tr = smp.trainer_logp ? smp.trainer_logp[i] : null;
    return el("tr", {class: "token-row"}, el("td", {}, JSON.stringify(t)), el("td", {class: "engine"}, fmt(e)),
              el("td", {class: "trainer"}, fmt(tr)), el("td", {}, tr == null ? "\u2013" : (tr - e).toFixed(4)));
  });
  box.replaceChildren(
    el("h3", {}, "step " + st.step + ", sample " + smp.index + ": reward " + smp.reward),
    el("p", {}, "tool calls: " + smp.tool_calls + "; staleness: " + smp.staleness + "; " + smp.tokens.length +
       " of " + smp.n_tokens + " response tokens shown; trainer log-probs: " + (smp.trainer_source ? "pi_old, recomputed before the update"
       : "not recorded (pi_old is the update's own log-prob; rollout/logprob_mismatch is the mismatch)")),
    el("h4", {}, "prompt"), el("pre", {class: "prompt"}, smp.prompt),
    el("h4", {}, "completion (policy text; tool results in italics)"), segs,
    el("div", {class: "scroll"}, el("table", {id: "token-table"},
      el("tr", {}, el("th", {}, "token"), el("th", {}, "engine log-prob"), el("th", {}, "trainer log-prob"),
         el("th", {}, "trainer - engine")), ...rows)));
}

function samplesPanel() {
  const s = section("panel-samples", "Samples",
    "Each step's highest- and lowest-reward samples. Click one for its prompt, completion and per-token log-probs.");
  const list = el("div", {class: "sample-list"});
  for (const st of DATA.steps) for (const smp of st.samples) {
    const b = el("button", {class: "sample", "data-step": st.step, "data-index": smp.index},
                 "step " + st.step + " #" + smp.index + " (reward " + short(smp.reward) + ")");
    b.addEventListener("click", () => sampleDetail(st, smp));
    list.append(b);
  }
  s.append(list, el("div", {id: "sample-detail"}, "No sample selected."));
}

metricsPanel(); timelinePanel(); stalenessPanel(); distributionsPanel(); mismatchPanel(); samplesPanel();
document.body.setAttribute("data-ready", "1");
"""

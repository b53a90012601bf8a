// The live page of an rlstream run: polls /api/state, keeps every row it got, redraws uPlot charts.
// window.rlstream exposes the charts (their data arrays) and the poll count for tests and the console.
"use strict";

const COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
const TIME_KEYS = [["time/wait_data", "wait for data"], ["time/collate", "collate"], ["time/logprobs", "logprobs"],
  ["time/update", "update"], ["time/weight_push", "weight push"], ["time/checkpoint", "checkpoint"]];
const POLL_MS = 1000;
const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];  // steps are whole numbers

const S = { metrics: [], history: [], latest: null, trainedStaleness: {}, engines: [] };
window.rlstream = { charts: {}, polls: 0, state: S };

function el(id) { return document.getElementById(id); }
function fmt(v, d = 3) { return v === null || v === undefined || Number.isNaN(v) ? "-" : Number(v).toFixed(d); }
function secs(s) { s = Math.floor(s); return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`; }

function chart(name, series, opts = {}) {
  // (Re)create chart `name` with the given series (the first is x); returns the uPlot instance.
  const box = el("chart-" + name);
  const old = window.rlstream.charts[name];
  if (old) old.destroy();
  box.textContent = "";
  const u = new uPlot({
    width: Math.max(300, (box.clientWidth || 560) - 4), height: 240,
    scales: { x: { time: false }, ...(opts.scales || {}) },
    axes: [{ label: opts.xlabel || "", ...(opts.steps ? { incrs: STEP_INCRS } : {}) }, { label: opts.ylabel || "" },
      ...(opts.axes || [])],
    series: [{ label: opts.xlabel || "x" }, ...series.map((s, i) => ({ stroke: COLORS[i % COLORS.length], width: 1.5, ...s }))],
    legend: { live: false },
  }, series.map(() => []).concat([[]]), box);
  window.rlstream.charts[name] = u;
  return u;
}

function setup() {
  const dots = (fill) => ({ show: true, size: 7, fill });
  chart("reward", [
    { label: "reward (mean)" }, { label: "accuracy (batch)" },
    { label: "held-out accuracy", width: 0, points: dots(COLORS[2]), stroke: COLORS[2] },
    { label: "held-out, weights changed midway", width: 0, points: dots("#fff"), stroke: COLORS[2] },
  ], { xlabel: "step", steps: true });
  chart("queue", [{ label: "queued groups" }, { label: "rollouts running" }, { label: "admission capacity" }],
    { xlabel: "seconds" });
  const bars = uPlot.paths.bars({ size: [0.4, 60] });
  chart("staleness", [
    { label: "trained groups", paths: bars, fill: COLORS[0] + "99", points: { show: false } },
    { label: "queued now", paths: bars, fill: COLORS[1] + "99", points: { show: false } },
  ], { xlabel: "head staleness (versions)", ylabel: "groups", steps: true,
    scales: { x: { time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5] } } });
  chart("time", TIME_KEYS.map(([, label]) => ({ label })), { xlabel: "step", ylabel: "s", steps: true });
  chart("engines", [], { xlabel: "seconds", ylabel: "busy fraction" });
  chart("throughput", [{ label: "tokens/s accepted" }, { label: "samples/s accepted", scale: "rate" }],
    { xlabel: "seconds", ylabel: "tokens/s", scales: { rate: {} },
      axes: [{ scale: "rate", side: 1, label: "samples/s", grid: { show: false } }] });
}

function rewardData() {
  const steps = S.metrics.filter((r) => !("eval/version" in r) && "step" in r);
  const evals = S.metrics.filter((r) => "eval/version" in r && "eval/accuracy" in r);
  const xs = [...new Set([...steps.map((r) => r.step), ...evals.map((r) => r.step)])].sort((a, b) => a - b);
  const at = (rows, x, key, keep = () => true) => {
    const r = rows.find((q) => q.step === x && keep(q));
    return r && key in r ? r[key] : null;
  };
  const moved = (r) => (r["eval/offversion_frac"] || 0) > 0;
  return [xs, xs.map((x) => at(steps, x, "reward/mean")), xs.map((x) => at(steps, x, "reward/accuracy")),
    xs.map((x) => at(evals, x, "eval/accuracy", (r) => !moved(r))),
    xs.map((x) => at(evals, x, "eval/accuracy", moved))];
}

function stalenessData() {
  const queued = (S.latest && S.latest.staleness.histogram) || {};
  const keys = [...new Set([...Object.keys(S.trainedStaleness), ...Object.keys(queued)].map(Number))].sort((a, b) => a - b);
  return [keys, keys.map((k) => S.trainedStaleness[k] || 0), keys.map((k) => queued[k] || 0)];
}

function engineData() {
  const names = [...new Set(S.history.flatMap((h) => Object.keys(h.engines || {})))].sort();
  if (names.join() !== S.engines.join()) {
    S.engines = names;
    chart("engines", names.map((n) => ({ label: n })), { xlabel: "seconds", ylabel: "busy fraction" });
  }
  // Busy fraction: the change of the engine's busy-seconds counter over the time between two samples.
  const busy = (n) => S.history.map((h, i) => {
    const p = S.history[i - 1], a = p && p.engines[n], b = h.engines[n];
    return a && b && h.ts > p.ts && "busy_seconds" in b ? Math.min(1, Math.max(0, (b.busy_seconds - a.busy_seconds) / (h.ts - p.ts))) : null;
  });
  return [S.history.map((h) => h.t), ...names.map(busy)];
}

function throughputData() {
  // The server's rates (launcher/live.py AcceptedRate): the numbers the console line shows.
  const h = S.history;
  return [h.map((p) => p.t), h.map((p) => p.tokens_per_s), h.map((p) => p.samples_per_s)];
}

function numbers(st) {
  const L = S.latest;
  const last = [...S.metrics].reverse().find((r) => !("eval/version" in r)) || {};
  const ev = [...S.metrics].reverse().find((r) => "eval/version" in r);
  const cells = [["step", last.step ?? 0], ["reward", fmt(last["reward/mean"])], ["batch accuracy", fmt(last["reward/accuracy"])]];
  if (ev) {
    // An evaluation during which the weights changed is not that version's accuracy alone: say so.
    const moved = ev["eval/offversion_frac"] || 0;
    cells.push(["held-out", `${fmt(ev["eval/accuracy"])} @v${ev["eval/version"]}` +
      (moved > 0 ? ` (${(100 * moved).toFixed(0)}% on later weights)` : "")]);
  }
  if (L) {
    const a = L.admission;
    cells.push(["version", `${L.versions.served} (trainer ${L.versions.trainer})`],
      ["queued", L.staleness.queued], ["running", a.running], ["accepted", a.accepted],
      ["capacity", `${a.capacity} of ${a.max_concurrent_rollouts}`], ["rejected", a.rejected],
      ["dropped stale", L.dropped.count], ["dead letters", L.dead_letters.count],
      ["engines", L.engines.filter((e) => e.alive).length]);
  }
  if (S.history.length) {
    const h = S.history[S.history.length - 1];
    cells.push(["samples/s", fmt(h.samples_per_s, 2)], ["tokens/s", fmt(h.tokens_per_s, 0)]);
  }
  if ("staleness/mean" in last) cells.push(["staleness (last step)", `${fmt(last["staleness/mean"], 2)} max ${fmt(last["staleness/max"], 0)}`]);
  el("numbers").innerHTML = "";
  for (const [k, v] of cells) {
    const d = document.createElement("div");
    d.innerHTML = "<small></small><b></b>";
    d.querySelector("small").textContent = k;
    d.querySelector("b").textContent = String(v);
    el("numbers").appendChild(d);
  }
  const status = el("status");
  const run = st.error ? "error" : (L && L.run) || "waiting";
  status.textContent = st.error ? `redis: ${st.error}` : run;
  status.className = "status " + run;
  const t = S.history.length ? S.history[S.history.length - 1].t : 0;
  el("footer").textContent = `${st.run_dir} · watching for ${secs(t)} · eta ${st.eta} · batch ${st.batch} groups`;
}

async function poll() {
  const q = `metrics_from=${S.metrics.length}&history_from=${S.historyNext || 0}`;
  const resp = await fetch(`/api/state?${q}`);
  if (!resp.ok) throw new Error(`/api/state: HTTP ${resp.status}`);
  const st = await resp.json();
  S.metrics.push(...st.metrics);
  S.history.push(...st.history);
  S.historyNext = st.history_next;
  if (st.latest) S.latest = st.latest;
  S.trainedStaleness = st.trained_staleness || {};
  document.title = el("title").textContent = `rlstream run ${st.title}`;
  const C = window.rlstream.charts;
  C.reward.setData(rewardData());
  C.queue.setData([S.history.map((h) => h.t), S.history.map((h) => h.queued), S.history.map((h) => h.running),
    S.history.map((h) => h.capacity)]);
  C.staleness.setData(stalenessData());
  const steps = S.metrics.filter((r) => !("eval/version" in r) && "step" in r);
  C.time.setData([steps.map((r) => r.step), ...TIME_KEYS.map(([k]) => steps.map((r) => r[k] ?? null))]);
  const eng = engineData();
  window.rlstream.charts.engines.setData(eng);
  C.throughput.setData(throughputData());
  numbers(st);
  window.rlstream.polls += 1;
}

async function loop() {
  try {
    await poll();
  } catch (err) {
    // The server is gone (the run ended) or restarting: say so and keep trying.
    el("status").textContent = `no answer from the server (${err.message}); retrying`;
    el("status").className = "status error";
  }
  setTimeout(loop, POLL_MS);
}

setup();
loop();

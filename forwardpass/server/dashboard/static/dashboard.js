"use strict";
// The forwardpass live dashboard: reads /dashboard/state over SSE (/dashboard/events), draws with canvas.
(function () {
  const $ = (id) => document.getElementById(id);
  const PALETTE = ["#1e88e5", "#c2185b", "#43a047", "#fb8c00", "#8e24aa", "#00897b", "#f4511e", "#3949ab",
                   "#7cb342", "#d81b60", "#00acc1", "#6d4c41"];
  // A request keeps its colour while it runs: the colour comes from its id, not its place in the list.
  function colourOf(rid) {
    let h = 0;
    for (let k = 0; k < rid.length; k++) h = (h * 31 + rid.charCodeAt(k)) >>> 0;
    return PALETTE[h % PALETTE.length];
  }

  function si(x, unit) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    const units = [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [f, p] of units) if (Math.abs(x) >= f) return (x / f).toPrecision(3) + " " + p + unit;
    return (Math.abs(x) < 10 ? x.toFixed(1) : x.toFixed(0)) + (unit ? " " + unit : "");
  }
  const ms = (s) => (s === null || s === undefined) ? "–" : (s * 1000).toFixed(s < 0.1 ? 1 : 0) + " ms";
  // a step's time: microseconds below one millisecond (a fast machine's prediction), else milliseconds
  const dur = (s) => (s === null || s === undefined) ? "–" : s < 1e-3 ? (s * 1e6).toFixed(1) + " µs" : ms(s);
  const times = (r) => (r === null || r === undefined) ? "–" : r.toFixed(r < 100 ? 1 : 0) + "×";
  const pct = (x) => (x === null || x === undefined) ? "–" : (100 * x).toFixed(1) + "%";

  function drawGrid(map) {
    const c = $("kv-grid"), g = c.getContext("2d");
    g.clearRect(0, 0, c.width, c.height);
    if (!map) return;
    const n = map.states.length;
    const cols = Math.max(1, Math.ceil(Math.sqrt(n * c.width / c.height)));
    const cell = Math.max(1, Math.floor(Math.min(c.width / cols, 22)));
    const rows = Math.ceil(n / cols);
    c.height = Math.max(40, rows * cell + 2);
    for (let b = 0; b < n; b++) {
      const s = map.states[b];
      g.fillStyle = s === 0 ? "#e3e7ee" : s === 1 ? "#b0bec5" : colourOf(map.requests[s - 2] || "");
      g.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, Math.max(1, cell - 1), Math.max(1, cell - 1));
    }
    $("kv-caption").textContent = `${n} blocks of ${map.block_size} tokens` + (map.shared ? `, ${map.shared} shared` : "");
    const list = $("running-list");
    list.textContent = "";
    map.requests.forEach((rid) => {
      const chip = document.createElement("span");
      chip.className = "chip"; chip.style.background = colourOf(rid); chip.textContent = rid.slice(0, 14);
      list.appendChild(chip);
    });
  }

  function drawBatchMix(steps) {
    const c = $("batch-mix"), g = c.getContext("2d");
    g.clearRect(0, 0, c.width, c.height);
    const max = Math.max(1, ...steps.map((s) => s.prefill + s.decode));
    const w = c.width / 60, h = c.height - 16;
    steps.forEach((s, i) => {
      const x = i * w, pf = h * s.prefill / max, dc = h * s.decode / max;
      g.fillStyle = "#1e88e5"; g.fillRect(x, h - dc, Math.max(1, w - 1), dc);
      g.fillStyle = "#c2185b"; g.fillRect(x, h - dc - pf, Math.max(1, w - 1), pf);
    });
    g.fillStyle = "#667"; g.font = "11px sans-serif"; g.fillText(`max ${max} tokens per step`, 4, c.height - 3);
  }

  function drawRoofline(state) {
    const c = $("roofline"), g = c.getContext("2d");
    g.clearRect(0, 0, c.width, c.height);
    const hw = state.hardware, steps = state.steps.filter((s) => s.intensity > 0 && s.flops_per_s > 0);
    const xs = steps.map((s) => s.intensity), ys = steps.map((s) => s.flops_per_s);
    if (hw) { xs.push(hw.peak_flops / hw.bandwidth); ys.push(hw.peak_flops); }
    if (!xs.length) { g.fillStyle = "#667"; g.fillText("no steps yet", 10, 20); return; }
    const lx0 = Math.log10(Math.min(...xs)) - 1, lx1 = Math.log10(Math.max(...xs)) + 1;
    const ly0 = Math.log10(Math.min(...ys)) - 1, ly1 = Math.log10(Math.max(...ys)) + 0.5;
    const L = 40, B = 20;
    const px = (x) => L + (Math.log10(x) - lx0) / (lx1 - lx0) * (c.width - L - 8);
    const py = (y) => (ly1 - Math.log10(y)) / (ly1 - ly0) * (c.height - B - 6) + 6;
    g.strokeStyle = "#ccd"; g.strokeRect(L, 6, c.width - L - 8, c.height - B - 6);
    g.fillStyle = "#667"; g.font = "10px sans-serif";
    for (let d = Math.ceil(lx0); d <= lx1; d++) g.fillText("1e" + d, px(10 ** d) - 8, c.height - 6);
    for (let d = Math.ceil(ly0); d <= ly1; d++) g.fillText("1e" + d, 4, py(10 ** d) + 3);
    if (hw) {
      g.strokeStyle = "#333"; g.lineWidth = 2; g.beginPath();
      for (let k = 0; k <= 100; k++) {
        const x = 10 ** (lx0 + (lx1 - lx0) * k / 100), y = Math.min(hw.peak_flops, hw.bandwidth * x);
        if (k === 0) g.moveTo(px(x), py(y)); else g.lineTo(px(x), py(y));
      }
      g.stroke(); g.lineWidth = 1;
      $("roofline-caption").textContent = `(${hw.name})`;
    } else {
      $("roofline-caption").textContent = "(no hardware peaks: run forwardpass roofline --hardware this-machine)";
    }
    steps.forEach((s) => {
      const fade = Math.max(0.15, 1 - s.age_s / 10);
      g.globalAlpha = fade;
      g.fillStyle = s.prefill ? "#c2185b" : "#1e88e5";
      g.beginPath(); g.arc(px(s.intensity), py(s.flops_per_s), 4, 0, 2 * Math.PI); g.fill();
    });
    g.globalAlpha = 1;
  }

  // Achieved FLOP/s (left axis) and bytes/s (right axis) by tokens per step, over every step so far, with the
  // hardware's peaks as dashed lines: a decode step of more sequences reads the same weights for more work.
  function drawBatching(state) {
    const c = $("batching"), g = c.getContext("2d"), rows = state.batching || [], hw = state.hardware;
    g.clearRect(0, 0, c.width, c.height);
    const body = $("batching-table").tBodies[0];
    body.textContent = "";
    rows.forEach((r) => {
      const row = body.insertRow();
      [r.tokens <= 2 ? String(r.tokens) : `${r.tokens / 2 + 1}–${r.tokens}`, r.steps, r.ms_per_step.toFixed(1),
       si(r.flops_per_s, "FLOP/s"), hw ? pct(r.flops_per_s / hw.peak_flops) : "–", si(r.bytes_per_s, "B/s"),
       hw ? pct(r.bytes_per_s / hw.bandwidth) : "–", r.intensity.toFixed(1)].forEach((v) => { row.insertCell().textContent = v; });
    });
    $("batching-caption").textContent = hw ? `; dashed: ${hw.name}'s peaks` : "";
    if (!rows.length) { g.fillStyle = "#667"; g.fillText("no steps yet", 10, 20); return; }
    const L = 50, R = 50, B = 22, T = 8, W = c.width - L - R, H = c.height - B - T;
    const maxF = Math.max(...rows.map((r) => r.flops_per_s), hw ? hw.peak_flops : 0) * 1.1;
    const maxB = Math.max(...rows.map((r) => r.bytes_per_s), hw ? hw.bandwidth : 0) * 1.1;
    const n = rows.length, px = (i) => L + (i + 0.5) * W / n;
    g.strokeStyle = "#ccd"; g.strokeRect(L, T, W, H);
    g.fillStyle = "#667"; g.font = "10px sans-serif";
    g.fillText(si(maxF, "FLOP/s"), 2, T + 8); g.fillText(si(maxB, "B/s"), c.width - R + 4, T + 8);
    rows.forEach((r, i) => g.fillText(String(r.tokens), px(i) - 6, c.height - 6));
    const line = (key, max, colour) => {
      g.strokeStyle = colour; g.fillStyle = colour; g.lineWidth = 2; g.beginPath();
      rows.forEach((r, i) => { const y = T + H - H * r[key] / max; if (i) g.lineTo(px(i), y); else g.moveTo(px(i), y); });
      g.stroke(); g.lineWidth = 1;
      rows.forEach((r, i) => { g.beginPath(); g.arc(px(i), T + H - H * r[key] / max, 3.5, 0, 2 * Math.PI); g.fill(); });
    };
    const peak = (v, max, colour) => {
      g.strokeStyle = colour; g.setLineDash([5, 4]); g.beginPath();
      g.moveTo(L, T + H - H * v / max); g.lineTo(L + W, T + H - H * v / max); g.stroke(); g.setLineDash([]);
    };
    if (hw) { peak(hw.peak_flops, maxF, "#c2185b"); peak(hw.bandwidth, maxB, "#1e88e5"); }
    line("flops_per_s", maxF, "#c2185b");
    line("bytes_per_s", maxB, "#1e88e5");
  }

  // Measured vs predicted time of the latest steps and their regime (what `explain --json` gives a step), and
  // the oversubscription warning when the server's judge finds decode far slower than predicted under load.
  function regimeBadge(regime) {
    const b = document.createElement("span");
    b.className = "rg " + (regime || "");
    b.textContent = regime || "–";
    return b;
  }
  function drawRegimes(state) {
    const steps = state.steps, last = steps.length ? steps[steps.length - 1] : null;
    const cell = $("regime");
    cell.textContent = "";
    cell.appendChild(regimeBadge(last && last.regime));
    $("regime-times").textContent = last && last.predicted_s !== null
      ? `${dur(last.duration_s)} / ${dur(last.predicted_s)} (${times(last.ratio)})` : "no prediction";
    const body = $("steps-table").tBodies[0];
    body.textContent = "";
    steps.slice(-12).reverse().forEach((s) => {
      const row = body.insertRow();
      [s.step, s.prefill, s.decode, dur(s.duration_s), dur(s.predicted_s), times(s.ratio)].forEach((v) => { row.insertCell().textContent = v; });
      row.insertCell().appendChild(regimeBadge(s.regime));
    });
    const warn = $("oversubscription"), o = state.oversubscription;
    warn.hidden = !(o && o.warning);
    warn.textContent = o && o.warning ? "⚠ " + o.warning : "";
  }

  function render(state) {
    $("requests-running").textContent = state.requests_running;
    $("requests-waiting").textContent = state.requests_waiting;
    $("kv-blocks-used").textContent = state.kv_blocks_used;
    $("kv-blocks-total").textContent = state.kv_blocks_total;
    $("tokens-per-s").textContent = state.tokens_per_s.toFixed(1);
    $("ttft").textContent = ms(state.ttft_s);
    $("tpot").textContent = ms(state.tpot_s);
    $("preemptions").textContent = state.preemptions;
    $("prefix-hit-rate").textContent = pct(state.prefix_cache_hit_rate);
    const sd = state.spec_decode;  // speculative decoding over the last window (null: no drafts verified)
    $("spec-acceptance").textContent = sd ? pct(sd.acceptance_rate) : "–";
    $("spec-length").textContent = sd ? `${sd.accepted} of ${sd.drafts} drafts, ` +
      `${sd.mean_acceptance_length.toFixed(2)} tokens per verify` : "speculative decoding off or idle";
    $("flops-per-s").textContent = si(state.achieved_flops_per_s, "FLOP/s");
    $("bytes-per-s").textContent = si(state.achieved_bytes_per_s, "B/s");
    $("mfu").textContent = pct(state.mfu);
    $("mbu").textContent = pct(state.mbu);
    $("model").textContent = state.model || "";
    const waiting = $("waiting-list");
    waiting.textContent = "";
    const ids = (state.blocks && state.blocks.waiting) || [];
    ids.slice(0, 40).forEach((rid) => {
      const chip = document.createElement("span");
      chip.className = "chip"; chip.style.background = "#90a4ae"; chip.textContent = rid.slice(0, 14);
      waiting.appendChild(chip);
    });
    const busy = state.requests_running + state.requests_waiting > 0;
    const status = $("status");
    status.textContent = busy ? "serving" : "idle";
    status.className = "status " + (busy ? "live" : "idle");
    drawGrid(state.blocks);
    drawBatchMix(state.steps);
    drawRoofline(state);
    drawBatching(state);
    drawRegimes(state);
  }

  // One SSE connection lasts a few seconds (so the server can shut down); EventSource reconnects by
  // itself — except after an answer it will not retry (an error status, some resets), when it closes for good
  // and the page would freeze with the server still up. So the page opens a new stream itself when the browser
  // has given up, and whenever no state has arrived for 3 s (then it also says "disconnected").
  let source = null, lastMessage = Date.now();
  // A server of several models: ?model=NAME picks whose engine this page shows (a selector lists them).
  const picked = new URLSearchParams(location.search).get("model");
  const query = picked ? "?model=" + encodeURIComponent(picked) : "";
  fetch("/v1/models").then((r) => r.json()).then((list) => {
    // only a server of several models lists each model's kind (a one-model server: no selector)
    const engines = list.data.filter((m) => m.kind === "generate" || m.kind === "transcribe");
    if (engines.length < 2) return;
    const select = $("model-select");
    for (const m of engines) {
      const option = document.createElement("option");
      option.value = option.textContent = m.id;
      select.appendChild(option);
    }
    select.value = picked || engines[0].id;
    select.onchange = () => { location.search = "?model=" + encodeURIComponent(select.value); };
    select.hidden = false;
  }).catch(() => {});
  function connect() {
    if (source) source.close();
    const s = new EventSource("/dashboard/events" + query);
    s.onmessage = (ev) => { lastMessage = Date.now(); render(JSON.parse(ev.data)); };
    s.onerror = () => { if (s === source && s.readyState === EventSource.CLOSED) setTimeout(connect, 1000); };
    source = s;
  }
  setInterval(() => {
    if (Date.now() - lastMessage > 3000) {
      const status = $("status");
      status.textContent = "disconnected"; status.className = "status down";
      connect();
    }
  }, 1000);
  fetch("/dashboard/state" + query).then((r) => r.json()).then(render).catch(() => {});
  connect();
  window.addEventListener("beforeunload", () => { if (source) source.close(); });
})();

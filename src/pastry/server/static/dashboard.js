// Pastry's dashboard: reads /dashboard/events (server-sent events, one a second) with the
// token in an Authorization header (so it never sits in an address or a log), keeps each
// engine's last ten minutes and draws them. No libraries: the server may run offline.
"use strict";

const HISTORY = 600;
const $ = (id) => document.getElementById(id);
const series = new Map(); // engine name -> [point, ...]
let token = null;
let latest = null;

function takeToken() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.get("token")) {
    sessionStorage.setItem("pastry-token", params.get("token"));
    history.replaceState(null, "", location.pathname + location.search);
  }
  token = sessionStorage.getItem("pastry-token");
}

function headers() {
  return token ? { Authorization: "Bearer " + token } : {};
}

function setStatus(text, kind) {
  const s = $("status");
  s.textContent = text;
  s.className = "pill " + (kind || "");
}

// ------------------------------------------------------------------ the stream

async function connect() {
  let wait = 500;
  for (;;) {
    try {
      const r = await fetch("/dashboard/events", { headers: headers(), cache: "no-store" });
      if (r.status === 401) return askForToken(token ? "that token was refused" : "");
      if (!r.ok) throw new Error("HTTP " + r.status);
      wait = 500;
      await readEvents(r.body.getReader());
    } catch (e) {
      setStatus("disconnected: " + e.message, "down");
    }
    await new Promise((ok) => setTimeout(ok, wait));
    wait = Math.min(wait * 2, 10000);
  }
}

async function readEvents(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the server ended the stream");
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: "))
        .map((l) => l.slice(6)).join("\n");
      if (data) update(JSON.parse(data));
    }
  }
}

function askForToken(why) {
  setStatus("needs a token", "degraded");
  $("login").hidden = false;
  $("login-error").textContent = why;
  $("login").onsubmit = (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    sessionStorage.setItem("pastry-token", token);
    $("login").hidden = true;
    connect();
  };
}

// ------------------------------------------------------------------ one snapshot

function update(snap) {
  latest = snap;
  for (const e of snap.engines) {
    const pts = series.get(e.name) || [];
    for (const p of e.points) {
      if (!pts.length || p.t > pts[pts.length - 1].t) pts.push(p);
    }
    if (pts.length > HISTORY) pts.splice(0, pts.length - HISTORY);
    series.set(e.name, pts);
  }
  const down = snap.engines.filter((e) => e.state !== "up");
  setStatus(down.length ? down.length + " engine(s) " + down.map((e) => e.state).join(", ")
                        : "ok", down.length ? "degraded" : "ok");
  $("who").textContent = snap.user + (snap.operator ? " (operator: every user's programs)"
                                                    : " (your programs)");
  $("models").textContent = snap.models.join(", ");
  const r = snap.router;
  $("router").textContent = "router: " + r.name + " (" + r.routed + " routed, " +
    r.fallback + " placed here)";
  summary(snap);
  programs(snap);
  engines(snap);
  charts(snap);
  document.body.dataset.updated = String(snap.now);
}

function last(name) {
  const pts = series.get(name) || [];
  return pts.length ? pts[pts.length - 1] : null;
}

function summary(snap) {
  const c = snap.counts;
  $("n-programs").textContent = c.total;
  $("n-running").textContent = c.running;
  $("n-waiting").textContent = c.waiting;
  $("n-swapped").textContent = c.swapped;
  let tps = 0, used = 0, total = 0, held = 0, cached = 0, asked = 0;
  for (const e of snap.engines) {
    const p = last(e.name);
    if (!p) continue;
    tps += p.tokens_s;
    used += p.kv.programs + p.kv.cache;
    total += p.kv.total;
    held += p.kv.programs;
  }
  for (const pts of series.values()) {
    for (const p of pts.slice(-60)) {
      cached += p.cached_tokens;
      asked += p.prompt_tokens;
    }
  }
  $("tokens-s").textContent = fmt(tps, 1);
  $("kv-used").textContent = used + " / " + total;
  $("kv-note").textContent = "KV pages used (" + held + " by programs)";
  $("cache-hit").textContent = asked ? pct(cached / asked) : "–";
}

function programs(snap) {
  const body = $("programs").tBodies[0];
  const rows = snap.programs.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.instance = String(p.id);
    tr.dataset.state = p.state;
    tr.dataset.pages = String(p.pages);
    const cells = [
      [String(p.id)], [p.name], [p.user], [p.runtime], [age(p.age_s), "num"],
      [String(p.tokens), "num"], [p.level === null ? "–" : String(p.level), "num"],
      [fmt(1000 * p.service_s, 1) + " ms", "num"],
      [p.pages + (p.swapped_pages ? " (" + p.swapped_pages + " on host)" : ""), "num"],
      [p.state, "state"],
    ];
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.className = "end";
    b.textContent = "terminate";
    b.onclick = () => terminate(p.id, p.name);
    td.appendChild(b);
    tr.appendChild(td);
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement("tr");
    tr.innerHTML = '<td colspan="11" class="empty">no programs running</td>';
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  const c = snap.counts;
  $("programs-note").textContent = c.total > snap.programs.length
    ? "(the " + snap.programs.length + " most served of " + c.total + ")" : "";
}

async function terminate(id, name) {
  if (!confirm("Terminate " + name + " (" + id + ")?")) return;
  const r = await fetch("/dashboard/terminate", {
    method: "POST", headers: { ...headers(), "Content-Type": "application/json" },
    body: JSON.stringify({ instance: id }),
  });
  if (!r.ok) alert((await r.json()).error.message);
}

function engines(snap) {
  const body = $("engines").tBodies[0];
  body.replaceChildren(...snap.engines.map((e) => {
    const p = last(e.name) || {};
    const tr = document.createElement("tr");
    tr.dataset.engine = e.name;
    const cells = [e.name, e.model, e.state, String(e.restarts), fmt(p.tokens_s, 1),
      fmt(p.batch, 1), p.step_ms == null ? "–" : fmt(p.step_ms, 1) + " ms",
      String(p.waiting ?? "–"), ms(p.ttft_p50_ms) + " / " + ms(p.ttft_p99_ms),
      ms(p.itl_p50_ms) + " / " + ms(p.itl_p99_ms)];
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    return tr;
  }));
}

// ------------------------------------------------------------------ charts

function charts(snap) {
  const root = $("charts");
  for (const e of snap.engines) {
    let box = root.querySelector('[data-engine="' + CSS.escape(e.name) + '"]');
    if (!box) {
      box = $("engine-charts").content.firstElementChild.cloneNode(true);
      box.dataset.engine = e.name;
      box.querySelector(".engine-name").textContent = "Engine " + e.name;
      root.appendChild(box);
    }
    const pts = series.get(e.name) || [];
    const p = pts[pts.length - 1];
    if (!p) continue;
    const kvNow = box.querySelector(".kv-now");
    kvNow.textContent = "programs " + p.kv.programs + ", prefix cache " + p.kv.cache +
      ", free " + p.kv.free + " of " + p.kv.total + "; swapped to host " + p.host.swapped;
    kvNow.dataset.programs = p.kv.programs;
    kvNow.dataset.cache = p.kv.cache;
    kvNow.dataset.free = p.kv.free;
    const minute = pts.slice(-60);
    box.querySelector(".cache-now").textContent = p.cached_pages + " pages cached; in the " +
      "last minute " + minute.reduce((s, q) => s + q.cached_tokens, 0) + " of " +
      minute.reduce((s, q) => s + q.prompt_tokens, 0) + " prompt tokens from the cache, " +
      minute.reduce((s, q) => s + q.evictions, 0) + " pages evicted";
    stacked(box.querySelector("canvas.kv"), pts, [
      ["programs", (q) => q.kv.programs, "--programs"],
      ["prefix cache", (q) => q.kv.cache, "--cache"],
      ["swapped (host)", (q) => q.host.swapped, "--swapped"],
      ["free", (q) => q.kv.free, "--free"],
    ]);
    lines(box.querySelector("canvas.pace"), pts, [
      ["tokens/s", (q) => q.tokens_s, "--a"], ["batch", (q) => q.batch, "--b", true],
    ]);
    lines(box.querySelector("canvas.latency"), pts, [
      ["TTFT p50", (q) => q.ttft_p50_ms, "--a"], ["TTFT p99", (q) => q.ttft_p99_ms, "--d"],
      ["ITL p50", (q) => q.itl_p50_ms, "--c"], ["ITL p99", (q) => q.itl_p99_ms, "--b"],
    ]);
    lines(box.querySelector("canvas.cache"), pts, [
      ["hit rate %", (q) => (q.cache_hit === null ? null : 100 * q.cache_hit), "--d"],
    ]);
  }
}

function color(v) {
  return getComputedStyle(document.documentElement).getPropertyValue(v).trim();
}

function frame(canvas) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, x0: 44, y0: canvas.height - 18, w: canvas.width - 54, h: canvas.height - 34 };
}

function axis(f, max, pts, label) {
  const { ctx, x0, y0, w, h } = f;
  ctx.strokeStyle = color("--line");
  ctx.fillStyle = color("--muted");
  ctx.beginPath();
  ctx.moveTo(x0, y0 - h); ctx.lineTo(x0, y0); ctx.lineTo(x0 + w, y0);
  ctx.stroke();
  ctx.fillText(fmt(max, max < 10 ? 1 : 0) + (label || ""), 2, y0 - h + 8);
  ctx.fillText("0", 30, y0);
  if (pts.length > 1) {
    const span = pts[pts.length - 1].t - pts[0].t;
    ctx.fillText("-" + age(span), x0, y0 + 14);
    ctx.fillText("now", x0 + w - 20, y0 + 14);
  }
}

function legend(f, items) {
  let x = f.x0 + 6;
  for (const [name, , v] of items) {
    f.ctx.fillStyle = color(v);
    f.ctx.fillRect(x, 4, 10, 10);
    f.ctx.fillStyle = color("--fg");
    f.ctx.fillText(name, x + 13, 13);
    x += f.ctx.measureText(name).width + 26;
  }
}

function xAt(f, i, n) {  // the points kept span the width (up to ten minutes)
  return f.x0 + (n <= 1 ? f.w : (f.w * i) / (n - 1));
}

// Lines; an item marked `own` gets its own scale (drawn dashed), labelled on the right.
function lines(canvas, pts, items) {
  const f = frame(canvas);
  const shared = items.filter((it) => !it[3]);
  const max = Math.max(1e-9, ...pts.flatMap((p) => shared.map(([, get]) => get(p) ?? 0)));
  axis(f, max, pts);
  for (const [name, get, v, own] of items) {
    const top = own ? Math.max(1e-9, ...pts.map((p) => get(p) ?? 0)) : max;
    f.ctx.strokeStyle = color(v);
    f.ctx.setLineDash(own ? [4, 3] : []);
    f.ctx.beginPath();
    let drawing = false;
    pts.forEach((p, i) => {
      const y = get(p);
      if (y === null || y === undefined) { drawing = false; return; }
      const px = xAt(f, i, pts.length), py = f.y0 - (f.h * y) / top;
      if (drawing) f.ctx.lineTo(px, py); else f.ctx.moveTo(px, py);
      drawing = true;
    });
    f.ctx.stroke();
    f.ctx.setLineDash([]);
    if (own) {
      f.ctx.fillStyle = color(v);
      f.ctx.fillText(name + " max " + fmt(top, 1), f.x0 + f.w - 90, f.y0 - f.h + 8);
    }
  }
  legend(f, items);
}

function stacked(canvas, pts, layers) {
  const f = frame(canvas);
  const max = Math.max(1, ...pts.map((p) => layers.reduce((s, [, get]) => s + get(p), 0)));
  axis(f, max, pts);
  const base = pts.map(() => 0);
  for (const [, get, v] of layers) {
    f.ctx.fillStyle = color(v);
    f.ctx.beginPath();
    pts.forEach((p, i) => {
      const x = xAt(f, i, pts.length), y = f.y0 - (f.h * (base[i] + get(p))) / max;
      if (i) f.ctx.lineTo(x, y); else f.ctx.moveTo(x, y);
    });
    for (let i = pts.length - 1; i >= 0; i--) {
      f.ctx.lineTo(xAt(f, i, pts.length), f.y0 - (f.h * base[i]) / max);
    }
    f.ctx.closePath();
    f.ctx.fill();
    pts.forEach((p, i) => { base[i] += get(p); });
  }
  legend(f, layers);
}

// ------------------------------------------------------------------ formatting

function fmt(x, digits) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits);
}
function ms(x) { return x === null || x === undefined ? "–" : fmt(x, x < 10 ? 1 : 0) + " ms"; }
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function age(s) {
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

takeToken();
connect();

// KVScope pool grid: one canvas cell per block of the device pool and of the host swap pool.
// Python sends compact base64 arrays (app/grid.py); this draws them, explains a block on
// hover, and reports a clicked block. Called again with new data on every redraw: the canvas,
// listeners and last data live on the root element between calls.

const STATE = ["free", "cached", "used", "shared", "reserved"];

function b64bytes(s) {
  const bin = atob(s), out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out.buffer;
}

function decode(d) {
  const n = d.n, m = d.m, dev = b64bytes(d.dev), host = b64bytes(d.host);
  return {
    ...d,
    owner: new Uint16Array(dev, 0, n), tokens: new Uint16Array(dev, 2 * n, n),
    hash: new Uint32Array(dev, 4 * n, n), state: new Uint8Array(dev, 8 * n, n),
    ref: new Uint8Array(dev, 9 * n, n), touch: new Uint8Array(dev, 10 * n, n),
    hOwner: new Uint16Array(host, 0, m), hTokens: new Uint16Array(host, 2 * m, m),
    hTouch: new Uint8Array(host, 4 * m, m),
  };
}

function tint(hex, a) {
  const v = parseInt(hex.slice(1), 16);
  return `rgba(${v >> 16},${(v >> 8) & 255},${v & 255},${a})`;
}

// Cell size and columns so that `count` cells fill the width within about `maxH` pixels.
function layout(count, width, maxH, maxCell) {
  if (!count) return { c: 0, cols: 0, rows: 0, h: 0 };
  let c = Math.floor(Math.sqrt((width * maxH) / count));
  c = Math.max(3, Math.min(maxCell, c));
  let cols = Math.max(1, Math.min(count, Math.floor(width / c)));
  const rows = Math.ceil(count / cols);
  return { c, cols, rows, h: rows * c };
}

function el(tag, cls, parent) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (parent) parent.appendChild(e);
  return e;
}

function setup(root, setTriggerValue) {
  const s = { root, draws: 0 };
  s.head = el("div", "head", root);
  s.canvas = el("canvas", "grid", root);
  s.hostHead = el("div", "head host-head", root);
  s.hostCanvas = el("canvas", "grid", root);
  s.legend = el("div", "legend", root);
  s.tip = el("div", "tip", root);
  s.ctx = s.canvas.getContext("2d");
  s.hctx = s.hostCanvas.getContext("2d");
  const hit = (canvas, geo, count, ev) => {
    const r = canvas.getBoundingClientRect();
    const x = ev.clientX - r.left, y = ev.clientY - r.top;
    if (!geo || !geo.c) return -1;
    const col = Math.floor(x / geo.c), row = Math.floor(y / geo.c);
    const i = row * geo.cols + col;
    return col >= 0 && col < geo.cols && row >= 0 && i < count ? i : -1;
  };
  const move = (host) => (ev) => {
    const d = s.data;
    if (!d) return;
    const canvas = host ? s.hostCanvas : s.canvas;
    const i = hit(canvas, host ? s.hgeo : s.geo, host ? d.m : d.n, ev);
    if (i < 0) { s.tip.style.display = "none"; return; }
    s.tip.innerHTML = host ? hostTip(d, i) : deviceTip(d, i);
    s.tip.style.display = "block";
    const rr = root.getBoundingClientRect();
    let x = ev.clientX - rr.left + 14, y = ev.clientY - rr.top + 14;
    if (x + s.tip.offsetWidth > rr.width) x = ev.clientX - rr.left - s.tip.offsetWidth - 10;
    s.tip.style.left = `${Math.max(0, x)}px`;
    s.tip.style.top = `${y}px`;
  };
  s.canvas.addEventListener("mousemove", move(false));
  s.hostCanvas.addEventListener("mousemove", move(true));
  for (const c of [s.canvas, s.hostCanvas]) c.addEventListener("mouseleave", () => (s.tip.style.display = "none"));
  s.canvas.addEventListener("click", (ev) => {
    const i = s.data ? hit(s.canvas, s.geo, s.data.n, ev) : -1;
    if (i >= 0) s.setTrigger("block", i);
  });
  s.setTrigger = setTriggerValue;
  new ResizeObserver(() => draw(s)).observe(root);
  return s;
}

const esc = (t) => String(t).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

function ownerName(d, o) {
  return o ? d.seqs[o - 1][0] : "";
}

function swatch(d, o) {
  if (!o) return "";
  const col = d.style.palette[d.seqs[o - 1][1]];
  return `<span class="sw" style="background:${col}"></span>`;
}

function deviceTip(d, i) {
  const st = STATE[d.state[i]], ref = d.ref[i];
  const owners = d.shared[i] || (d.owner[i] ? [d.owner[i]] : []);
  const lines = [`<b>Block ${i}</b> · ${st}${ref ? ` · ref count ${ref}` : ""}`];
  if (owners.length) lines.push(`held by ${owners.map((o) => swatch(d, o) + esc(ownerName(d, o))).join(", ")}`);
  if (ref || st === "cached") lines.push(`${d.tokens[i]} / ${d.bs} tokens`);
  if (st === "cached") lines.push("no holder: evictable, still hit-able");
  if (st === "reserved") lines.push("never handed out: the engine's placeholder (vLLM's null block)");
  if (d.hash[i] || st === "cached") lines.push(`hash ${(d.hash[i] >>> 0).toString(16).padStart(8, "0")}…`);
  if (d.touch[i]) lines.push(`<span class="tk" style="border-color:${d.style.touch[d.touch[i] - 1]}"></span>${d.style.touchLabels[d.touch[i] - 1]} in step ${d.step}`);
  return lines.join("<br>");
}

function hostTip(d, i) {
  const o = d.hOwner[i];
  const lines = [`<b>Host block ${i}</b> · ${o ? "holds a swapped-out block" : "free"}`];
  if (o) lines.push(`of ${swatch(d, o)}${esc(ownerName(d, o))} · ${d.hTokens[i]} / ${d.bs} tokens`);
  if (d.hTouch[i]) lines.push(`${d.style.touchLabels[d.hTouch[i] - 1]} in step ${d.step}`);
  return lines.join("<br>");
}

function prepareCanvas(canvas, ctx, width, height) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.round(width * dpr), h = Math.round(height * dpr);
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w; canvas.height = h;
    canvas.style.width = `${width}px`; canvas.style.height = `${height}px`;
  }
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
}

// One cell: background by state, the filled fraction in the owner's colour, then marks.
function cell(ctx, d, x, y, c, stt, owner, tokens, ref, touch, id, tints) {
  const g = c >= 10 ? 2 : c >= 5 ? 1 : 0, s = c - g;
  const sty = d.style;
  if (stt === 0) { ctx.fillStyle = sty.free; ctx.fillRect(x, y, s, s); }
  else if (stt === 4) {  // reserved: dark, crossed out
    ctx.fillStyle = sty.reserved; ctx.fillRect(x, y, s, s);
    if (s >= 6) {
      ctx.strokeStyle = "rgba(255,255,255,0.6)"; ctx.lineWidth = 1; ctx.beginPath();
      ctx.moveTo(x, y); ctx.lineTo(x + s, y + s); ctx.moveTo(x, y + s); ctx.lineTo(x + s, y); ctx.stroke();
    }
  } else if (stt === 1) {
    ctx.fillStyle = sty.cached; ctx.fillRect(x, y, s, s);
    if (s >= 8) {
      ctx.strokeStyle = "rgba(255,255,255,0.7)"; ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(x, y + s); ctx.lineTo(x + s, y); ctx.stroke();
    }
  } else {
    const ci = owner ? d.seqs[owner - 1][1] : 0;
    const frac = Math.min(1, tokens / d.bs), fh = Math.round(s * frac);
    if (fh < s) { ctx.fillStyle = tints[ci]; ctx.fillRect(x, y, s, s - fh); }
    ctx.fillStyle = sty.palette[ci]; ctx.fillRect(x, y + s - fh, s, fh);
    if (stt === 3) {
      if (s >= 14) {
        ctx.fillStyle = "#fff"; ctx.font = `bold ${Math.round(s * 0.5)}px system-ui, sans-serif`;
        ctx.textAlign = "center"; ctx.textBaseline = "middle";
        ctx.fillText(`×${ref}`, x + s / 2, y + s / 2 + 1);
      } else {
        const t = Math.max(3, Math.round(s * 0.5));
        ctx.fillStyle = "#fff"; ctx.beginPath();
        ctx.moveTo(x + s - t, y); ctx.lineTo(x + s, y); ctx.lineTo(x + s, y + t); ctx.fill();
      }
    }
  }
  if (s >= 26 && stt !== 3) {
    ctx.fillStyle = stt >= 2 ? "rgba(255,255,255,0.85)" : "rgba(71,85,105,0.7)";  // reserved too
    ctx.font = "9px system-ui, sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "top";
    ctx.fillText(String(id), x + 2, y + 2);
  }
  if (touch) {
    ctx.strokeStyle = sty.touch[touch - 1];
    if (s < 7) { ctx.fillStyle = sty.touch[touch - 1]; ctx.fillRect(x, y, s, s); return; }
    const lw = s >= 16 ? 3 : 2;
    ctx.lineWidth = lw; ctx.strokeRect(x + lw / 2, y + lw / 2, s - lw, s - lw);
  }
}

function draw(s) {
  const d = s.data;
  if (!d) return;
  const t0 = performance.now();
  const width = Math.max(120, s.root.clientWidth);
  const maxCell = d.n <= 64 ? 56 : 44;
  s.geo = layout(d.n, width, d.n > 2048 ? 520 : 400, maxCell);
  s.hgeo = layout(d.m, width, 90, Math.max(6, Math.min(Math.round(s.geo.c * 0.6), 22)));
  const tints = d.style.palette.map((h) => tint(h, 0.3));
  const { c, cols } = s.geo;
  prepareCanvas(s.canvas, s.ctx, cols * c, s.geo.h);
  let used = 0;
  for (let i = 0; i < d.n; i++) {
    const stt = d.state[i];
    used += stt === 2 || stt === 3;
    cell(s.ctx, d, (i % cols) * c, Math.floor(i / cols) * c, c, stt, d.owner[i], d.tokens[i], d.ref[i], d.touch[i], i, tints);
  }
  // blocks a paused run-to-next-key-event points at: a thick dark ring, on top of everything
  for (const i of d.highlight || []) {
    if (i >= d.n) continue;
    const x = (i % cols) * c, y = Math.floor(i / cols) * c, w = Math.max(2, Math.round(c / 6));
    s.ctx.strokeStyle = "#0f172a"; s.ctx.lineWidth = w;
    s.ctx.strokeRect(x + w / 2, y + w / 2, c - w, c - w);
  }
  const hg = s.hgeo;
  prepareCanvas(s.hostCanvas, s.hctx, hg.cols * hg.c, hg.h);
  for (let i = 0; i < d.m; i++) {
    const o = d.hOwner[i];
    cell(s.hctx, d, (i % hg.cols) * hg.c, Math.floor(i / hg.cols) * hg.c, hg.c, o ? 2 : 0, o, d.hTokens[i], 1, d.hTouch[i], i, tints);
  }
  const k = d.counts;
  const mode = !d.live ? `<span class="past">◀ time travel: event ${d.seq}</span>`
    : d.connected === false ? `<span class="past">● not connected: event ${d.seq}, the last received</span>`
    : '<span class="live">● live</span>';
  s.head.innerHTML = `${mode} <b>Device pool</b> · ${d.n} blocks × ${d.bs} tokens · step ${d.step}` +
    ` · <span class="num">${k.used}</span> used (${k.shared} shared) · ${k.cached} cached · ${k.free} free`;
  s.hostHead.innerHTML = `<b>Host swap pool</b> · ${d.m} blocks · <span class="num">${k.host_used}</span> hold swapped-out blocks`;
  s.hostHead.style.display = s.hostCanvas.style.display = d.m ? "" : "none";
  s.legend.innerHTML = legend(d);
  s.draws++;
  // for tests and the latency bench: what was drawn, when (wall clock) and how long it took
  const now = Date.now(), ms = performance.now() - t0;
  window.__kvscope_grid = { seq: d.seq, drawnAt: now, draws: s.draws, used, n: d.n, live: d.live,
    connected: d.connected !== false, highlight: (d.highlight || []).length, drawMs: ms };
  const log = (window.__kvscope_draws ||= []);
  log.push([d.seq, now, ms]);
  if (log.length > 20000) log.splice(0, 10000);
  s.root.dataset.seq = d.seq;
  s.root.dataset.used = used;
}

function legend(d) {
  const sty = d.style, k = d.counts, pal = sty.palette;
  const box = (bg, extra = "") => `<span class="box" style="background:${bg}">${extra}</span>`;
  const parts = [
    `${box(sty.free)}free ${k.free}`,
    `${box(sty.cached, '<i class="hatch"></i>')}cached ${k.cached} <small>(no holder: evictable, still hit-able)</small>`,
    `${box(`linear-gradient(to top, ${pal[0]} 60%, ${tint(pal[0], 0.3)} 60%)`)}used: colour = sequence, fill = tokens in block`,
    `${box(pal[0], '<b class="ref">×2</b>')}shared: ref count`,
  ];
  const reserved = d.n - k.free - k.cached - k.used;
  if (reserved > 0) parts.push(`${box(sty.reserved)}reserved ${reserved} <small>(never handed out)</small>`);
  const touched = sty.touchKinds.map((kind, i) => [kind, i]).filter(([kind]) => d.touched[kind])
    .map(([kind, i]) => `<span class="box ring" style="border-color:${sty.touch[i]}"></span>${sty.touchLabels[i]} ${d.touched[kind]}`);
  const seqs = d.seqs.slice(0, 24).map(([id, ci, status]) =>
    `<span class="chip" style="background:${pal[ci]}" title="${esc(status)}">${esc(id)}${status === "swapped" ? " ⇣" : status === "waiting" ? " …" : ""}</span>`);
  if (d.seqs.length > 24) seqs.push(`+${d.seqs.length - 24} more`);
  return `<div>${parts.join(" ")}</div>` +
    `<div><span class="lbl">step ${d.step}:</span> ${touched.length ? touched.join(" ") : "<small>no block touched</small>"}</div>` +
    (seqs.length ? `<div><span class="lbl">sequences:</span> ${seqs.join(" ")}</div>` : "");
}

export default function (component) {
  const { data, parentElement, setTriggerValue } = component;
  const root = parentElement.querySelector(".kv");
  if (!root || !data) return;
  const s = root.__kv || (root.__kv = setup(root, setTriggerValue));
  s.setTrigger = setTriggerValue;
  s.data = decode(data);
  draw(s);
}

// KVScope pool grid at any size. Python (app/panels/grid.py) sends binary frames: a whole frame or a
// delta from the frame this browser holds, with the other live views' data (assets/live.js, the
// first part of this component's script). This keeps the columns, draws an overview of the
// whole pool and a zoomed region with per-block detail, explains a block on hover, reports a
// clicked block, and asks for the next frame as soon as it holds this one, before drawing it, so
// that Python's redraw and the browser's drawing overlap (the ask, "sync": the frame token it
// holds, the message whose panels it holds, and the block under the pointer). It asks by its
// lane (app/panels/lane.py: a WebSocket of the dashboard's process, no Streamlit rerun) while Python
// keeps the lane open, else by setStateValue, a Streamlit rerun. Whether it is open is Python's
// answer (Redraw.lane_may_draw: a rerun's `lane.open`, the lane's "streamlit"), never decided here.
// State lives on the root element between calls.

// The block records' layout and the state codes are app/panels/grid.py's (its STYLE's `record` and
// `states`), set by `layout` when the style comes with a frame: this file has no copy of them.
let DEV, HOST, TIER, R, STATE, FREE, CACHED, USED, SHARED, RESERVED;
function layout(st) {
  const d = st.record.dev, h = st.record.host;
  DEV = d.size; HOST = h.size; TIER = st.record.tier.size;  // bytes per device / host / host-tier block
  R = { owner: d.owner / 4, hash: d.hash / 4, ref: d.ref / 2, tokens: d.tokens / 2, state: d.state, touch: d.touch, group: d.group,
    hOwner: h.owner / 4, hTokens: h.tokens / 2, hTouch: h.touch, hRef: h.ref,
    tHash: st.record.tier.hash / 4, tTouch: st.record.tier.touch, tHeld: st.record.tier.held };  // field offsets in units of their own width
  STATE = [];
  for (const [name, code] of Object.entries(st.states)) STATE[code] = name;
  ({ free: FREE, cached: CACHED, used: USED, shared: SHARED, reserved: RESERVED } = st.states);
}
const MIN_COUNT = 64;             // the most zoomed-in region
const DETAIL = 5;                 // cells at least this wide get per-block detail
const esc = (t) => String(t).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const fmt = (x) => Number(x).toLocaleString("en-US");
const noun = (n, word, many) => (n === 1 ? word : many || word + "s");
const plural = (n, word, many) => `${fmt(n)} ${noun(n, word, many)}`;  // as app/derived/words.py

// ------------------------------------------------------------------ frames
function columnsDev(buf) {
  return { buf, u8: new Uint8Array(buf), u16: new Uint16Array(buf), u32: new Uint32Array(buf) };
}
const owner = (c, i) => c.u32[DEV / 4 * i + R.owner], hash = (c, i) => c.u32[DEV / 4 * i + R.hash],
  ref = (c, i) => c.u16[DEV / 2 * i + R.ref], tokens = (c, i) => c.u16[DEV / 2 * i + R.tokens],
  state = (c, i) => c.u8[DEV * i + R.state], touch = (c, i) => c.u8[DEV * i + R.touch],
  group = (c, i) => c.u8[DEV * i + R.group];  // its KV-cache group (a hybrid pool's; else 0)
const hOwner = (c, i) => c.u32[HOST / 4 * i + R.hOwner], hTokens = (c, i) => c.u16[HOST / 2 * i + R.hTokens],
  hTouch = (c, i) => c.u8[HOST * i + R.hTouch];
const hRef = (c, i) => c.u8[HOST * i + R.hRef];  // sequences holding a host block (a fork group swapped together shares it)
// a block of the host tier (protocol 3): the hash it holds, whether it holds one, what the step did to it
const tHash = (c, i) => c.u32[TIER / 4 * i + R.tHash], tHeld = (c, i) => c.u8[TIER * i + R.tHeld],
  tTouch = (c, i) => c.u8[TIER * i + R.tTouch];
const hState = (c, i) => (hRef(c, i) > 1 ? SHARED : hRef(c, i) ? USED : FREE);  // as on the device

async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

async function parse(bytes) {
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (String.fromCharCode(...bytes.subarray(0, 4)) !== "KVG1") throw new Error("not a KVScope grid frame");
  const hlen = dv.getUint32(4, true);
  const head = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + hlen)));
  let body = bytes.subarray(Math.ceil((8 + hlen) / 16) * 16);
  if (head.deflated) body = await inflate(body);
  const buf = body.buffer.slice(body.byteOffset, body.byteOffset + body.byteLength);  // aligned, owned
  const part = (name, size) => {
    const p = head.parts[name];
    return p ? buf.slice(p[0], p[0] + p[1] * size) : new ArrayBuffer(0);
  };
  return { head, part };
}

function apply(s, { head, part }) {
  if (head.style) { s.style = head.style; s.styles = (s.styles || 0) + 1; layout(s.style); }
  if (!s.style) return false;  // a grid mounted afresh while Python thought it had the style: ask again, with it
  s.version = (s.version || 0) + 1;
  if (head.kind === "full") {
    s.dev = columnsDev(part("dev", DEV));
    s.host = columnsDev(part("host", HOST));
    s.seqs = new Map(head.seqs.map(([k, ...v]) => [k, v]));
    s.changes = { since: s.version, list: [] };  // every pixel is new
    s.touchList = scanTouched(head.n, (i) => touch(s.dev, i));
    s.hostTouchList = scanTouched(head.m, (i) => hTouch(s.host, i));
  } else {
    // a delta applies to any frame it names (those sent after the last one acknowledged)
    if (!(head.bases || [head.base]).includes(s.token) || !s.dev) return false;  // not from here: ask again
    const devIdx = new Uint32Array(part("devIdx", 4)), hostIdx = new Uint32Array(part("hostIdx", 4));
    patch(s.dev.u32, devIdx, new Uint32Array(part("dev", DEV)), DEV / 4, head.n);
    patch(s.host.u32, hostIdx, new Uint32Array(part("host", HOST)), HOST / 4, head.m);
    for (const k of head.gone) s.seqs.delete(k);
    let recolored = false;  // a sequence's colour is its own for life: never, but then repaint all
    for (const [k, ...v] of head.seqs) {
      const old = s.seqs.get(k);
      recolored ||= old !== undefined && old[1] !== v[1];
      s.seqs.set(k, v);
    }
    const c = s.changes;
    if (recolored) { c.since = s.version; c.list = []; }
    c.list.push({ version: s.version, dev: devIdx, host: hostIdx });
    if (c.list.length > MAX_CHANGES) c.since = c.list.shift().version;  // older caches repaint all
    // a block's touch mark changes only with its record: the blocks touched are those of the
    // last list and of this delta that still are
    s.touchList = stillTouched(s.touchList, devIdx, (i) => touch(s.dev, i));
    s.hostTouchList = stillTouched(s.hostTouchList, hostIdx, (i) => hTouch(s.host, i));
  }
  s.tier = head.o ? columnsDev(part("tier", TIER)) : null;  // sent whole with every frame
  s.token = head.token;
  s.msg = head.msg;  // the message whose panels it now holds (grid.show records panels by message)
  s.data = head;
  if (head.focus) s.focus = head.focus;
  return true;
}

const MAX_CHANGES = 32;  // deltas remembered for the canvases' pixel caches

function changedSince(s, version, host) {
  const c = s.changes;
  if (!c || version < c.since) return null;
  return c.list.filter((x) => x.version > version).map((x) => (host ? x.host : x.dev));
}

function scanTouched(size, code) {
  const out = [];
  for (let i = 0; i < size; i++) if (code(i)) out.push(i);
  return out;
}

function stillTouched(last, changed, code) {
  const out = new Set();
  for (const i of last) if (code(i)) out.add(i);
  for (const i of changed) if (code(i)) out.add(i);
  return [...out];
}

function patch(dst, idx, rows, words, size) {
  for (let j = 0; j < idx.length; j++) {
    const i = idx[j];
    if (i < size) dst.set(rows.subarray(j * words, (j + 1) * words), i * words);
  }
}

// ------------------------------------------------------------------ colours
function rgb(hex) {
  const v = parseInt(hex.slice(1), 16);
  return [v >> 16, (v >> 8) & 255, v & 255];
}
const rgba = (hex, a) => { const [r, g, b] = rgb(hex); return `rgba(${r},${g},${b},${a})`; };

function palette(s) {
  if (s.pal && s.pal.style === s.style) return s.pal;
  const st = s.style;
  s.pal = { style: st, free: rgb(st.free), cached: rgb(st.cached), shared: rgb(st.shared), used: rgb(st.palette[0]),
    reserved: rgb(st.reserved),
    seq: st.palette.map(rgb), tint: st.palette.map((h) => rgba(h, 0.3)), sharedTint: rgba(st.shared, 0.45) };
  return s.pal;
}

// A hybrid pool's group colours (the frame's `groups`: [name, colour, used, cached] each), as rgb.
function groupRGB(s) {
  const gs = s.data.groups || [];
  if (s.gpal && s.gpal.src === gs.map((x) => x[1]).join()) return s.gpal.rgb;
  s.gpal = { src: gs.map((x) => x[1]).join(), rgb: gs.map((x) => rgb(x[1])) };
  return s.gpal.rgb;
}
const byGroup = (s) => s.mode === "group" && s.data.groups;

// The colour of device block i in the overview: by state, by sequence, or by KV-cache group.
function devRGB(s, i, pal) {
  const stt = state(s.dev, i);
  if (stt === FREE) return pal.free;
  if (byGroup(s) && stt !== RESERVED) return groupRGB(s)[group(s.dev, i)] || pal.used;
  if (stt === CACHED) return pal.cached;
  if (stt === SHARED) return pal.shared;
  if (stt === RESERVED) return pal.reserved;
  if (s.mode === "state") return pal.used;
  const q = s.seqs.get(owner(s.dev, i));
  return q ? pal.seq[q[1]] : pal.used;
}
function hostRGB(s, i, pal) {
  const stt = hState(s.host, i);
  if (stt === FREE) return pal.free;
  if (stt === SHARED) return pal.shared;
  const q = s.seqs.get(hOwner(s.host, i));
  return s.mode === "state" || !q ? pal.used : pal.seq[q[1]];
}

// ------------------------------------------------------------------ layout and painting
// Where `count` blocks from `start` go in a width x maxH box: cells of c pixels in `cols`
// columns, or (c < 1) k blocks averaged into each pixel.
function geometry(start, count, width, maxH) {
  const c0 = Math.sqrt((width * maxH) / Math.max(1, count));
  if (c0 >= 1) {
    const c = Math.max(1, Math.min(56, Math.floor(c0)));
    const cols = Math.max(1, Math.min(count, Math.floor(width / c)));
    const rows = Math.ceil(count / cols);
    return { start, count, c, cols, rows, k: 1, w: cols * c, h: rows * c };
  }
  const k = Math.ceil(count / (width * maxH)), cols = width, rows = Math.ceil(count / (k * cols));
  return { start, count, c: 1, cols, rows, k, w: cols, h: rows };
}

// Block position -> pixel rectangle [x, y, size] (the pixel for k > 1).
function place(g, i) {
  const j = Math.floor((i - g.start) / g.k);
  return [(j % g.cols) * g.c, Math.floor(j / g.cols) * g.c, g.c];
}

function prepare(canvas, ctx, w, h) {
  const dpr = window.devicePixelRatio || 1;
  const W = Math.max(1, Math.round(w * dpr)), H = Math.max(1, Math.round(h * dpr));
  if (canvas.width !== W || canvas.height !== H) {
    canvas.width = W; canvas.height = H;
    canvas.style.width = `${w}px`; canvas.style.height = `${h}px`;
  }
  ctx.setTransform(1, 0, 0, 1, 0, 0);
  ctx.clearRect(0, 0, W, H);
  return dpr;
}

// Pixels: each block a c x c square, or k blocks averaged into one pixel (a density heat).
// The canvas keeps its pixels: a redraw recolours only those of the blocks changed since, so
// a million-block overview costs what changed (`changed(v)`: the lists of blocks changed since
// version v, or null when v is too old to say; `key`: what else the pixels depend on).
function paintPixels(canvas, ctx, g, colour, changed, key, version) {
  const dpr = prepare(canvas, ctx, g.w, g.h);
  const end = g.start + g.count;
  const square = (i) => {  // block i's c x c square (k = 1)
    const [r, gr, b] = colour(i), j = i - g.start;
    const x0 = (j % g.cols) * g.c, y0 = Math.floor(j / g.cols) * g.c;
    for (let y = y0; y < y0 + g.c; y++) {
      let o = (y * g.w + x0) * 4;
      for (let x = 0; x < g.c; x++, o += 4) { px[o] = r; px[o + 1] = gr; px[o + 2] = b; px[o + 3] = 255; }
    }
  };
  const pixel = (p) => {  // the blocks of pixel p, averaged (k > 1)
    let r = 0, gr = 0, b = 0, n = 0;
    for (let i = g.start + p * g.k, stop = Math.min(end, i + g.k); i < stop; i++, n++) {
      const c = colour(i); r += c[0]; gr += c[1]; b += c[2];
    }
    const o = p * 4;
    px[o] = r / n; px[o + 1] = gr / n; px[o + 2] = b / n; px[o + 3] = 255;
  };
  const keep = canvas.__pixels, same = keep && keep.key === key;
  let since = same ? changed(keep.version) : null;
  if (since && since.reduce((n, blocks) => n + blocks.length, 0) > g.count / 4) since = null;  // a jump: all afresh
  const img = since ? keep.img : ctx.createImageData(g.w, g.h), px = img.data;
  if (since) {
    const seen = new Set();
    for (const blocks of since) {
      for (const i of blocks) {
        if (i < g.start || i >= end) continue;
        if (g.k === 1) square(i);
        else { const p = Math.floor((i - g.start) / g.k); if (!seen.has(p)) { seen.add(p); pixel(p); } }
      }
    }
  } else if (g.k === 1) {
    for (let i = g.start; i < end; i++) square(i);
  } else {
    for (let p = 0; p * g.k < g.count; p++) pixel(p);
  }
  canvas.__pixels = { key, img, version };
  ctx.putImageData(img, 0, 0);
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);  // what is drawn next is in CSS pixels
  // ImageData ignores the transform: stretch what was put to the CSS size
  if (dpr !== 1) { ctx.imageSmoothingEnabled = false; ctx.drawImage(canvas, 0, 0, g.w, g.h, 0, 0, g.w, g.h); }
}

// Detail: one cell per block with its fill, ref count, id and outline.
function paintCells(canvas, ctx, s, g, host) {
  const dpr = prepare(canvas, ctx, g.w, g.h);
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  const pal = palette(s), end = g.start + g.count;
  for (let i = g.start; i < end; i++) {
    const j = i - g.start;
    cell(ctx, s, pal, (j % g.cols) * g.c, Math.floor(j / g.cols) * g.c, g.c, i, host);
  }
}

function cell(ctx, s, pal, x, y, c, i, host) {
  const gap = c >= 10 ? 2 : c >= 5 ? 1 : 0, z = c - gap, sty = s.style, bs = s.data.bs;
  const stt = host ? hState(s.host, i) : state(s.dev, i);
  if (stt === FREE) { ctx.fillStyle = sty.free; ctx.fillRect(x, y, z, z); }
  else if (stt === RESERVED) {  // reserved: dark, crossed out
    ctx.fillStyle = sty.reserved; ctx.fillRect(x, y, z, z);
    if (z >= 6) {
      ctx.strokeStyle = "rgba(255,255,255,0.6)"; ctx.lineWidth = 1; ctx.beginPath();
      ctx.moveTo(x, y); ctx.lineTo(x + z, y + z); ctx.moveTo(x, y + z); ctx.lineTo(x + z, y); ctx.stroke();
    }
  } else if (stt === CACHED) {
    ctx.fillStyle = !host && byGroup(s) ? rgba(s.data.groups[group(s.dev, i)][1], 0.45) : sty.cached;
    ctx.fillRect(x, y, z, z);
    if (z >= 8) {
      ctx.strokeStyle = "rgba(255,255,255,0.7)"; ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(x, y + z); ctx.lineTo(x + z, y); ctx.stroke();
    }
  } else {
    const tok = host ? hTokens(s.host, i) : tokens(s.dev, i), fh = Math.round(z * Math.min(1, tok / bs));
    let full, part;
    if (!host && byGroup(s)) { full = s.data.groups[group(s.dev, i)][1]; part = rgba(full, 0.3); }
    else if (stt === SHARED) { full = sty.shared; part = pal.sharedTint; }  // shared: a style of its own
    else {
      const q = s.seqs.get(host ? hOwner(s.host, i) : owner(s.dev, i)), ci = q ? q[1] : 0;
      full = s.mode === "state" ? sty.palette[0] : sty.palette[ci];
      part = s.mode === "state" ? pal.tint[0] : pal.tint[ci];
    }
    if (fh < z) { ctx.fillStyle = part; ctx.fillRect(x, y, z, z - fh); }
    ctx.fillStyle = full; ctx.fillRect(x, y + z - fh, z, fh);
    if (stt === SHARED) {
      ctx.fillStyle = "#fff";
      if (z >= 14) {  // at 26 px and more the id sits above it (below)
        ctx.font = `bold ${Math.round(z * (z >= 26 ? 0.36 : 0.45))}px system-ui, sans-serif`;
        ctx.textAlign = "center"; ctx.textBaseline = "middle";
        ctx.fillText(`×${host ? hRef(s.host, i) : ref(s.dev, i)}`, x + z / 2, y + (z >= 26 ? z * 0.66 : z / 2 + 1));
      } else if (z >= 4) {
        const t = Math.max(2, Math.round(z * 0.5));
        ctx.beginPath(); ctx.moveTo(x + z - t, y); ctx.lineTo(x + z, y); ctx.lineTo(x + z, y + t); ctx.fill();
      }
    }
  }
  if (z >= 26 && stt !== RESERVED) {
    ctx.fillStyle = stt !== FREE && stt !== CACHED ? "rgba(255,255,255,0.85)" : "rgba(71,85,105,0.7)";
    ctx.font = "9px system-ui, sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "top";
    ctx.fillText(String(i), x + 2, y + 2);
  }
  const t = host ? hTouch(s.host, i) : touch(s.dev, i);
  if (t && z >= 7) {
    const lw = z >= 16 ? 3 : 2;
    ctx.strokeStyle = sty.touch[t - 1]; ctx.lineWidth = lw;
    ctx.strokeRect(x + lw / 2, y + lw / 2, z - lw, z - lw);
  }
}

// The latest step's touched blocks, visible at every size: a mark at least 4 px wide.
function paintTouched(ctx, s, g, list, host) {
  const end = g.start + g.count, sty = s.style;
  if (g.c >= 7) return;  // cells draw their own outlines
  for (const i of list) {
    if (i < g.start || i >= end) continue;
    const t = host ? hTouch(s.host, i) : touch(s.dev, i), [x, y, c] = place(g, i);
    const z = Math.max(4, c), ox = x + c / 2 - z / 2, oy = y + c / 2 - z / 2;
    ctx.fillStyle = "#fff"; ctx.fillRect(ox - 1, oy - 1, z + 2, z + 2);
    ctx.fillStyle = sty.touch[t - 1]; ctx.fillRect(ox, oy, z, z);
  }
}

// Blocks a paused run-to-next-key-event points at: a thick dark ring on top of everything,
// or a dark mark at least 6 px wide where cells are small.
function paintHighlight(ctx, g, list, ink) {
  const end = g.start + g.count;
  ctx.strokeStyle = ctx.fillStyle = ink;
  for (const i of list) {
    if (i < g.start || i >= end) continue;
    const [x, y, c] = place(g, i);
    if (g.k === 1 && c >= 8) {
      const w = Math.max(2, Math.round(c / 6));
      ctx.lineWidth = w;
      ctx.strokeRect(x + w / 2, y + w / 2, c - w, c - w);
      if (c >= 26) {  // the ring covers the cell's id: write it again, on the ring
        const label = String(i);
        ctx.font = "bold 9px system-ui, sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "top";
        ctx.fillRect(x, y, ctx.measureText(label).width + 5, 12);
        ctx.fillStyle = "#fff"; ctx.fillText(label, x + 2, y + 1);
        ctx.fillStyle = ink;
      }
    } else {
      const z = Math.max(6, c);
      ctx.fillRect(x + c / 2 - z / 2, y + c / 2 - z / 2, z, z);
    }
  }
}

// The host tier: a cell per block, hatched like a cached device block while it holds content
// (no holder: only a prefix lookup reads it), outlined by what the latest step did to it.
function paintTier(canvas, ctx, s, g) {
  const sty = s.style, pal = palette(s);
  if (g.k === 1 && g.c >= DETAIL) {
    const dpr = prepare(canvas, ctx, g.w, g.h);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    for (let i = 0; i < g.count; i++) {
      const [x, y, c] = place(g, i), gap = c >= 10 ? 2 : c >= 5 ? 1 : 0, z = c - gap;
      ctx.fillStyle = tHeld(s.tier, i) ? sty.cached : sty.free;
      ctx.fillRect(x, y, z, z);
      if (tHeld(s.tier, i) && z >= 8) {
        ctx.strokeStyle = "rgba(255,255,255,0.7)"; ctx.lineWidth = 1;
        ctx.beginPath(); ctx.moveTo(x, y + z); ctx.lineTo(x + z, y); ctx.stroke();
      }
      const t = tTouch(s.tier, i);
      if (t && z >= 7) {
        const lw = z >= 16 ? 3 : 2;
        ctx.strokeStyle = sty.tierTouch[t - 1]; ctx.lineWidth = lw;
        ctx.strokeRect(x + lw / 2, y + lw / 2, z - lw, z - lw);
      }
    }
    return;
  }
  const key = [g.w, g.h, g.k, g.c, s.styles, s.version].join();  // small: painted afresh each frame
  paintPixels(canvas, ctx, g, (i) => (tHeld(s.tier, i) ? pal.cached : pal.free), () => null, key, s.version);
  for (let i = 0; i < g.count; i++) {
    const t = tTouch(s.tier, i);
    if (!t) continue;
    const [x, y, c] = place(g, i), z = Math.max(4, c);
    ctx.fillStyle = sty.tierTouch[t - 1]; ctx.fillRect(x + c / 2 - z / 2, y + c / 2 - z / 2, z, z);
  }
}

function tierTip(s, i) {
  const held = tHeld(s.tier, i);
  const lines = [`<b>Host tier block T${fmt(i)}</b> · ${held ? "holds a full block a prefix lookup can load back"
    : "free"}`];
  if (held) lines.push(`hash ${tHash(s.tier, i).toString(16).padStart(8, "0")}… · ${s.data.bs} / ${s.data.bs} tokens` +
    '<br><span class="dim">tier: host (no sequence holds it; a device miss of this prefix loads it)</span>');
  const t = tTouch(s.tier, i);
  if (t) lines.push(`<span class="tk" style="border-color:${s.style.tierTouch[t - 1]}"></span>${s.style.tierLabels[t - 1]} in step ${s.data.step}`);
  return lines.join("<br>");
}

function paint(canvas, ctx, s, g, host) {
  const pal = palette(s);
  if (g.k === 1 && g.c >= DETAIL) paintCells(canvas, ctx, s, g, host);
  else {
    // the pixels stay right while the geometry, the colouring and the palettes do
    const key = [g.start, g.count, g.w, g.h, g.k, g.c, s.mode, s.styles, groupRGB(s).join()].join();
    paintPixels(canvas, ctx, g, host ? (i) => hostRGB(s, i, pal) : (i) => devRGB(s, i, pal),
      (version) => changedSince(s, version, host), key, s.version);
  }
  paintTouched(ctx, s, g, host ? s.hostTouchList : s.touchList, host);
}

// ------------------------------------------------------------------ the views
function el(tag, cls, parent, html) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (html !== undefined) e.innerHTML = html;
  if (parent) parent.appendChild(e);
  return e;
}

function setup(root) {
  const s = { root, draws: 0, token: null, pulls: 0, lastPull: 0, lastMsg: 0, mode: "sequence", hover: null,
    range: null, queue: Promise.resolve(), hooks: "testHooks" in root.dataset, gen: 0,
    id: Math.random().toString(36).slice(2), lane: null };
  const box = (s.box = setupPanels(s, root));  // the live views around the grid: assets/live.js
  s.head = el("div", "head", box);
  s.bar = el("div", "bar", box);
  s.over = el("canvas", "grid overview", box);
  s.canvas = el("canvas", "grid main", box);
  s.hostHead = el("div", "head host-head", box);
  s.hostCanvas = el("canvas", "grid", box);
  s.tierHead = el("div", "head host-head tier-head", box);
  s.tierCanvas = el("canvas", "grid tier", box);
  s.legend = el("div", "legend", box);
  s.err = el("div", "err", box);
  s.tip = el("div", "tip", root);
  s.octx = s.over.getContext("2d");
  s.ctx = s.canvas.getContext("2d");
  s.hctx = s.hostCanvas.getContext("2d");
  s.tctx = s.tierCanvas.getContext("2d");
  box.tabIndex = 0;
  s.bar.innerHTML = '<button data-z="all" title="Show the whole pool (Home)">Whole pool</button>' +
    '<button data-z="out" title="Zoom out (−, or the wheel)">−</button><button data-z="in" title="Zoom in (+, or the wheel)">+</button>' +
    '<span class="range"></span><span class="sp"></span><span class="cb">colour by <button data-m="sequence">sequence</button>' +
    '<button data-m="state">state</button><button data-m="group">group</button></span>' +
    '<span class="hint">wheel zooms · drag pans · keys + − ↑ ↓ PgUp PgDn Home</span>';
  s.bar.addEventListener("click", (ev) => {
    const b = ev.target.closest("button");
    if (!b) return;
    if (b.dataset.m) { s.mode = b.dataset.m; draw(s); }
    if (b.dataset.z === "all") setRange(s, 0, s.data.n);
    if (b.dataset.z === "in") zoomAt(s, center(s), 0.5);
    if (b.dataset.z === "out") zoomAt(s, center(s), 2);
  });
  wireMain(s);
  wireOverview(s);
  s.hostCanvas.addEventListener("mousemove", (ev) => hoverAt(s, ev, s.hgeo, true));
  s.tierCanvas.addEventListener("mousemove", (ev) => {
    const i = s.tgeo && s.tier ? blockAt(s.tgeo, s.tierCanvas, ev) : -1;
    if (i < 0) return setHover(s, null);
    s.hover = null;
    showTip(s, ev, tierTip(s, i));
  });
  for (const c of [s.canvas, s.over, s.hostCanvas, s.tierCanvas]) c.addEventListener("mouseleave", () => setHover(s, null));
  box.addEventListener("keydown", (ev) => key(s, ev));
  // the width read here, where layout is fresh, not in draw (a read there would lay the page out
  // again after the panels' new HTML); only the width changes what is drawn
  new ResizeObserver(() => {
    const width = box.clientWidth;
    if (width === s.width) return;
    s.width = width;
    if (s.data) draw(s);
  }).observe(box);
  const beat = setInterval(() => {  // a lost answer never stops the redraws
    if (!root.isConnected) { clearInterval(beat); if (s.lane) s.lane.ws.close(); return; }  // a page drawn afresh
    const now = performance.now();
    if (s.lane && s.lane.asked && now - s.lastPull > 3000) { s.lane.asked = false; s.lane.ws.close(); }  // stuck: Streamlit's way
    if (s.data && now - s.lastPull > 3000 && now - s.lastMsg > 3000) pull(s, true);
  }, 1000);
  return s;
}

const center = (s) => s.range.start + s.range.count / 2;

function setRange(s, start, count) {
  const n = s.data.n;
  count = Math.round(Math.max(Math.min(MIN_COUNT, n), Math.min(n, count)));
  start = Math.round(Math.max(0, Math.min(n - count, start)));
  s.range = { start, count, n };
  draw(s);
}

function zoomAt(s, block, factor, frac = 0.5) {
  const count = s.range.count * factor;
  setRange(s, block - frac * count, count);
}

function pan(s, blocks) {
  setRange(s, s.range.start + blocks, s.range.count);
}

function key(s, ev) {
  if (!s.range) return;
  const g = s.geo, row = g ? g.cols * g.k : 1, page = s.range.count;
  const act = { "+": () => zoomAt(s, center(s), 0.5), "=": () => zoomAt(s, center(s), 0.5), "-": () => zoomAt(s, center(s), 2),
    ArrowDown: () => pan(s, row), ArrowUp: () => pan(s, -row), PageDown: () => pan(s, page), PageUp: () => pan(s, -page),
    Home: () => setRange(s, 0, s.data.n), End: () => setRange(s, s.data.n - s.range.count, s.range.count) }[ev.key];
  if (act) { act(); ev.preventDefault(); }
}

function blockAt(g, canvas, ev) {
  const r = canvas.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
  if (!g || x < 0 || y < 0 || x >= g.w || y >= g.h) return -1;
  const j = Math.floor(y / g.c) * g.cols + Math.floor(x / g.c), i = g.start + j * g.k;
  return j >= 0 && i < g.start + g.count ? i : -1;
}

function wireMain(s) {
  const c = s.canvas;
  let drag = null;
  c.addEventListener("wheel", (ev) => {
    if (!s.geo) return;
    ev.preventDefault();
    const i = blockAt(s.geo, c, ev), at = i >= 0 ? i : center(s);
    const frac = (at - s.range.start) / s.range.count;
    zoomAt(s, at, ev.deltaY < 0 ? 0.8 : 1.25, frac);
  }, { passive: false });
  c.addEventListener("mousedown", (ev) => { drag = { y: ev.clientY, start: s.range.start, moved: false }; });
  window.addEventListener("mouseup", () => setTimeout(() => (drag = null), 0));
  c.addEventListener("mousemove", (ev) => {
    if (drag && ev.buttons & 1) {
      const dy = ev.clientY - drag.y, g = s.geo;
      if (Math.abs(dy) > 3) drag.moved = true;
      if (drag.moved) setRange(s, drag.start - Math.round(dy / g.c) * g.cols * g.k, s.range.count);
      return;
    }
    hoverAt(s, ev, s.geo, false);
  });
  c.addEventListener("click", (ev) => {
    if (drag && drag.moved) return;
    const i = blockAt(s.geo, c, ev);
    if (i >= 0 && s.geo.k === 1) s.setTrigger("block", i);
  });
}

function wireOverview(s) {
  const o = s.over;
  const go = (ev) => {
    const i = blockAt(s.ogeo, o, ev);
    if (i >= 0) setRange(s, i - s.range.count / 2, s.range.count);
  };
  o.addEventListener("mousedown", go);
  o.addEventListener("mousemove", (ev) => {
    if (ev.buttons & 1) go(ev);
    else hoverAt(s, ev, s.ogeo, false);
  });
}

// ------------------------------------------------------------------ hover
function setHover(s, h) {
  s.hover = h;
  if (!h) { s.tip.style.display = "none"; return; }
  clearTimeout(s.hoverTimer);
  if (!s.focus || s.focus.b !== h.b || s.focus.host !== h.host) s.hoverTimer = setTimeout(() => pull(s), 80);
}

function hoverAt(s, ev, g, host) {
  if (!s.data || !g) return;
  const canvas = ev.currentTarget, i = blockAt(g, canvas, ev);
  if (i < 0) return setHover(s, null);
  if (g.k > 1) {  // a pixel of many blocks: what it sums up
    s.hover = null;
    showTip(s, ev, rangeTip(s, i, Math.min(g.k, g.start + g.count - i)));
    return;
  }
  if (!s.hover || s.hover.b !== i || s.hover.host !== host) setHover(s, { b: i, host });
  s.tipAt = ev;
  showTip(s, ev, host ? hostTip(s, i) : deviceTip(s, i));
}

function showTip(s, ev, html) {
  s.tip.innerHTML = html;
  s.tip.style.display = "block";
  const rr = s.root.getBoundingClientRect();
  let x = ev.clientX - rr.left + 14;
  const y = ev.clientY - rr.top + 14;
  if (x + s.tip.offsetWidth > rr.width) x = ev.clientX - rr.left - s.tip.offsetWidth - 10;
  s.tip.style.left = `${Math.max(0, x)}px`;
  s.tip.style.top = `${y}px`;
}

function refreshTip(s) {
  const h = s.hover;
  if (h && s.tipAt && s.tip.style.display === "block") s.tip.innerHTML = h.host ? hostTip(s, h.b) : deviceTip(s, h.b);
}

function swatch(s, ci) {
  return `<span class="sw" style="background:${s.style.palette[ci]}"></span>`;
}

function focusLines(s, i, host) {
  const f = s.focus;
  if (!f || f.b !== i || f.host !== host) return ['<span class="dim">…</span>'];
  const lines = [];
  if (f.holders.length > 1 || (f.holders.length && host)) {
    lines.push("held by " + f.holders.map(([id, ci, li]) => `${swatch(s, ci)}${esc(id)} <span class="dim">#${li}</span>`).join(", ") +
      (f.more ? ` and ${f.more} more` : ""));
  }
  if (f.text !== null && f.text !== undefined) lines.push(`<span class="txt">“${esc(f.text)}${f.text.length >= 40 ? "…" : ""}”</span>`);
  else lines.push('<span class="dim">text not known to this dashboard</span>');
  return lines;
}

function deviceTip(s, i) {
  const d = s.dev, st = STATE[state(d, i)], r = ref(d, i);
  const lines = [`<b>Block ${fmt(i)}</b> · ${st}${r ? ` · ref count ${r}` : ""}${s.data.o ? " · tier: device" : ""}`];
  const gs = s.data.groups;
  if (gs && (r || st === "cached")) {  // a hybrid pool: the KV-cache group whose table holds it, or whose cache keeps it
    const [name, colour] = gs[group(d, i)] || [`group ${group(d, i)}`, "#94a3b8"];
    lines.push(`<span class="sw" style="background:${colour}"></span>KV-cache ${esc(name)}`);
  }
  if (r === 1) {
    const q = s.seqs.get(owner(d, i));
    if (q) lines.push(`held by ${swatch(s, q[1])}${esc(q[0])}`);
  }
  if (r || st === "cached") lines.push(`${tokens(d, i)} / ${s.data.bs} tokens`);
  if (st === "cached") lines.push("no holder: evictable, still hit-able");
  if (st === "reserved") lines.push("never handed out: the engine's placeholder (vLLM's null block)");
  if (st !== "free" && st !== "reserved") lines.push(...focusLines(s, i, false));
  if (hash(d, i) || st === "cached") lines.push(`<span class="dim">hash ${(hash(d, i) >>> 0).toString(16).padStart(8, "0")}…</span>`);
  const t = touch(d, i);
  if (t) {  // a block evicted and handed out again in one step outlines as evicted: say both
    const again = s.style.touchKinds[t - 1] === "evict" && r ? ", then handed out again" : "";
    lines.push(`<span class="tk" style="border-color:${s.style.touch[t - 1]}"></span>${s.style.touchLabels[t - 1]} in step ${s.data.step}${again}`);
  }
  return lines.join("<br>");
}

function hostTip(s, i) {
  const o = hOwner(s.host, i), q = o ? s.seqs.get(o) : null, n = hRef(s.host, i);
  const lines = [`<b>Host block ${fmt(i)}</b> · ${n > 1 ? `ref count ${n}: one copy shared by ${n} swapped-out sequences`
    : n ? "holds a swapped-out block" : "free"}`];
  const f = s.focus, gs = s.data.groups;
  if (n && gs && f && f.b === i && f.host && gs[f.group]) lines.push(`of KV-cache ${esc(gs[f.group][0])}`);
  if (n > 1) lines.push(`${hTokens(s.host, i)} / ${s.data.bs} tokens`, ...focusLines(s, i, true));
  if (q) lines.push(`of ${swatch(s, q[1])}${esc(q[0])} · ${hTokens(s.host, i)} / ${s.data.bs} tokens`, ...focusLines(s, i, true));
  const t = hTouch(s.host, i);
  if (t) lines.push(`${s.style.touchLabels[t - 1]} in step ${s.data.step}`);
  return lines.join("<br>");
}

function rangeTip(s, i, k) {
  const n = STATE.map(() => 0);
  for (let j = i; j < i + k; j++) n[state(s.dev, j)]++;
  return `<b>Blocks ${fmt(i)}–${fmt(i + k - 1)}</b> (one pixel)<br>${n[USED] + n[SHARED]} used (${n[SHARED]} shared) · ${n[CACHED]} cached · ${n[FREE]} free` +
    (n[RESERVED] ? ` · ${n[RESERVED]} reserved` : "") +
    '<br><span class="dim">zoom in for each block</span>';
}

// ------------------------------------------------------------------ drawing
function draw(s) {
  const d = s.data;
  if (!d) return;
  const t0 = performance.now();
  const width = Math.max(120, s.width ?? s.box.clientWidth), mainH = d.n > 2048 ? 520 : 400;
  const all = geometry(0, d.n, width, mainH);
  const small = all.k === 1 && all.c >= 8;  // the whole pool fits with room for detail
  if (!s.range || s.range.n !== d.n) {
    const count = small ? d.n : Math.min(d.n, Math.floor((width * mainH) / (14 * 14)));
    s.range = { start: 0, count, n: d.n };
  }
  s.range.n = d.n;
  if (s.range.start + s.range.count > d.n) s.range.start = Math.max(0, d.n - s.range.count);
  const whole = s.range.count >= d.n;
  s.over.style.display = whole ? "none" : "";
  s.bar.style.display = small && whole && !d.groups ? "none" : "";  // a hybrid pool: "colour by group" stays in reach
  if (!whole) {
    s.ogeo = geometry(0, d.n, width, d.n > 65536 ? 160 : 110);
    paint(s.over, s.octx, s, s.ogeo, false);
    paintHighlight(s.octx, s.ogeo, d.highlight || [], s.style.ink);
    viewport(s);
  }
  s.geo = geometry(s.range.start, s.range.count, width, mainH);
  paint(s.canvas, s.ctx, s, s.geo, false);
  paintHighlight(s.ctx, s.geo, d.highlight || [], s.style.ink);
  s.hgeo = null;  // a pool without host blocks (vLLM's, --num-host-blocks 0) has no host canvas to paint
  if (d.m) {
    s.hgeo = geometry(0, d.m, width, 90);
    if (s.hgeo.k === 1) s.hgeo = geometry(0, d.m, width, Math.min(90, s.hgeo.rows * Math.max(6, Math.min(22, Math.round(s.geo.c * 0.6)))));
    paint(s.hostCanvas, s.hctx, s, s.hgeo, true);
  }
  s.tgeo = null;  // a pool without a host tier (--host-blocks 0, the default) has no tier canvas
  if (d.o && s.tier) {
    s.tgeo = geometry(0, d.o, width, 90);
    if (s.tgeo.k === 1) s.tgeo = geometry(0, d.o, width, Math.min(90, s.tgeo.rows * Math.max(6, Math.min(22, Math.round(s.geo.c * 0.6)))));
    paintTier(s.tierCanvas, s.tctx, s, s.tgeo);
  }
  header(s, whole);
  s.legend.innerHTML = legend(s);
  refreshTip(s);
  s.draws++;
  const k = d.counts;
  s.root.dataset.seq = d.seq;
  s.root.dataset.used = k.used;
  if (!s.hooks) return;
  // for tests and the latency bench (the app's KVSCOPE_TEST_HOOKS=1): what was drawn, when (wall
  // clock) and how long it took
  const now = Date.now(), ms = performance.now() - t0;
  window.__kvscope_grid = { seq: d.seq, step: d.step, drawnAt: now, draws: s.draws, used: k.used, n: d.n, m: d.m, live: d.live, drawMs: ms,
    token: s.token, start: s.range.start, count: s.range.count, kind: d.kind, cell: s.geo.c, perPixel: s.geo.k, overviewPerPixel: whole ? 0 : s.ogeo.k,
    touched: s.touchList.length, connected: d.connected !== false, highlight: (d.highlight || []).length,
    groups: d.groups ? d.groups.length : 1, mode: s.mode, tier: d.o ? { blocks: d.o, held: d.tier.held } : null };
  const log = (window.__kvscope_draws ||= []);
  log.push([d.seq, now, ms]);
  if (log.length > 20000) log.splice(0, 10000);
}

function viewport(s) {
  const g = s.ogeo, ctx = s.octx, r = s.range;
  const [x0, y0] = place(g, r.start), [x1, y1, c] = place(g, Math.min(r.start + r.count, s.data.n) - 1);
  ctx.save();
  ctx.strokeStyle = ctx.fillStyle = s.style.accent; ctx.lineWidth = 2;
  const tint = (x, y, w, h) => { ctx.globalAlpha = 0.12; ctx.fillRect(x, y, w, h); ctx.globalAlpha = 1; };
  if (y0 === y1) { tint(x0, y0, x1 + c - x0, c); ctx.strokeRect(x0, y0 - 1, x1 + c - x0, c + 2); }
  else { tint(0, y0, g.w, y1 + c - y0); ctx.strokeRect(1, y0 - 1, g.w - 2, y1 + c - y0 + 2); }
  ctx.restore();
}

function header(s, whole) {
  const d = s.data, k = d.counts, g = s.geo;
  const mode = !d.live ? `<span class="past">◀ time travel: event ${fmt(d.seq)}</span>`
    : d.connected === false ? `<span class="past">● not connected: event ${fmt(d.seq)}, the last received</span>`
    : '<span class="live">● live</span>';
  s.head.innerHTML = `${mode} <b>Device pool</b> · ${plural(d.n, "block")} × ${plural(d.bs, "token")} · step ${fmt(d.step)}` +
    ` · <span class="num">${fmt(k.used)}</span> used (${fmt(k.shared)} shared) · ${fmt(k.cached)} cached · ${fmt(k.free)} free`;
  const r = s.range, scale = g.k > 1 ? `${g.k} blocks per pixel` : g.c >= DETAIL ? `${g.c} px per block` : `${g.c} px per block, zoom in for detail`;
  s.bar.querySelector(".range").textContent = whole ? `whole pool · ${scale}` :
    `blocks ${fmt(r.start)}–${fmt(r.start + r.count - 1)} of ${fmt(d.n)} · ${scale}`;
  for (const b of s.bar.querySelectorAll("button[data-m]")) {
    b.classList.toggle("on", b.dataset.m === s.mode);
    if (b.dataset.m === "group") b.style.display = d.groups ? "" : "none";  // a hybrid pool's KV-cache groups
  }
  s.hostHead.innerHTML = `<b>Host swap pool</b> · ${plural(d.m, "block")} · <span class="num">${fmt(k.host_used)}</span> hold swapped-out blocks`;
  s.hostHead.style.display = s.hostCanvas.style.display = d.m ? "" : "none";
  const tier = d.tier || { blocks: 0, held: 0 };
  s.tierHead.innerHTML = `<b>Host tier</b> · ${plural(tier.blocks, "block")} · <span class="num">${fmt(tier.held)}</span> hold full blocks ` +
    '<small>(stored as they complete; a prefix the device missed is loaded back from here)</small>';
  s.tierHead.style.display = s.tierCanvas.style.display = d.o ? "" : "none";
}

function legend(s) {
  const d = s.data, sty = s.style, k = d.counts, pal = sty.palette;
  const box = (bg, extra = "") => `<span class="box" style="background:${bg}">${extra}</span>`;
  const used = s.mode === "state" ? `${box(pal[0])}used ${fmt(k.used - k.shared)}` :
    `${box(`linear-gradient(to top, ${pal[0]} 60%, ${rgba(pal[0], 0.3)} 60%)`)}used ${fmt(k.used - k.shared)}: colour = sequence, fill = tokens in block`;
  const parts = [
    `${box(sty.free)}free ${fmt(k.free)}`,
    `${box(sty.cached, '<i class="hatch"></i>')}cached ${fmt(k.cached)} <small>(no holder: evictable, still hit-able)</small>`,
    used,
    `${box(sty.shared, '<b class="ref">×2</b>')}shared ${fmt(k.shared)} <small>(held by several: ×ref count)</small>`,
  ];
  if (byGroup(s)) {  // colour = group: each group's swatch and blocks instead of the states'
    parts.splice(1, 3, ...d.groups.map(([name, colour, n, cached]) =>
      `${box(colour)}${esc(name)} <span class="num">${fmt(n)}</span> <small>used, ${fmt(cached)} cached (lighter)</small>`));
  }
  const reserved = d.n - k.free - k.cached - k.used;
  if (reserved > 0) parts.push(`${box(sty.reserved)}reserved ${fmt(reserved)} <small>(never handed out)</small>`);
  const touched = sty.touchKinds.map((kind, i) => [kind, i]).filter(([kind]) => d.touched[kind])
    .map(([kind, i]) => {
      const [events, blocks] = d.touched[kind];
      return `<span class="box ring" style="border-color:${sty.touch[i]}"></span>${sty.touchLabels[i]} ` +
        `<span class="num">${fmt(events)}</span> <small>${noun(events, "event")}, ${plural(blocks, "block")} outlined</small>`;
    });
  const seqs = [...s.seqs.values()].slice(0, 24).map(([id, ci, status]) =>
    `<span class="chip" style="background:${pal[ci]}" title="${esc(status)}">${esc(id)}${status === "swapped" ? " ⇣" : status === "waiting" ? " …" : ""}</span>`);
  if (s.seqs.size > 24) seqs.push(`+${fmt(s.seqs.size - 24)} more`);
  return `<div>${parts.join(" ")}</div>` +
    `<div><span class="lbl">step ${fmt(d.step)}:</span> ${touched.length ? touched.join(" ") : "<small>no block touched</small>"}</div>` +
    (seqs.length ? `<div><span class="lbl">sequences:</span> ${seqs.join(" ")}</div>` : "");
}

// ------------------------------------------------------------------ the exchange with Python
function pull(s, streamlit = false) {
  clearTimeout(s.pullTimer);
  s.pullTimer = null;
  const lane = !streamlit && s.lane && s.lane.open && s.lane.ws.readyState === WebSocket.OPEN ? s.lane : null;
  if (lane && lane.asked) return;  // one ask at a time: its answer asks again
  s.lastPull = performance.now();
  if (s.hooks) (s.pulledAt ||= new Map()).set(s.pulls + 1, Date.now());
  const h = s.hover;
  const sync = { el: s.id, have: s.token, msg: s.msg, pull: ++s.pulls, focus: h ? [h.b, h.host ? 1 : 0] : null, style: s.style ? 1 : 0 };
  if (lane) { lane.asked = true; lane.ws.send(JSON.stringify(sync)); } else s.setState("sync", sync);
}

// The lane (Python says where, in a rerun's frame): a frame by it needs no Streamlit rerun. It
// answers "streamlit" when the redraw needs one (then this asks that way until a rerun opens it
// again); one that cannot be reached, or closes, is left for a minute: asks go by Streamlit.
function useLane(s, where) {
  const url = where && location.protocol === "http:" ? `ws://${location.hostname}:${where.port}/` : null;
  if (s.lane && s.lane.url === url && s.lane.token === where.token) { s.lane.open = where.open; return; }
  if (s.lane) s.lane.ws.close();
  s.lane = null;
  if (!url || performance.now() - (s.laneFailed || -1e9) < 60000) return;
  const ws = new WebSocket(url), lane = { url, token: where.token, open: where.open, ws, asked: false };
  ws.binaryType = "arraybuffer";
  ws.onopen = () => ws.send(where.token);
  ws.onmessage = (ev) => {
    lane.asked = false;
    if (typeof ev.data === "string") { lane.open = false; pull(s, true); return; }
    const bytes = new Uint8Array(ev.data), arrived = Date.now();
    s.queue = s.queue.then(() => receive(s, bytes, arrived));
  };
  ws.onclose = () => {
    if (s.lane !== lane) return;
    s.lane = null;
    s.laneFailed = performance.now();
    if (lane.asked) pull(s, true);
  };
  s.lane = lane;
}

// For the bench (test hooks on): where this redraw's time went, from the ask to the drawn canvas
// (bench/dashboard.py LEGS), and whether a live view named another event than the grid.
function profile(s, head, arrived, received, browser) {
  const p = head.prof, pulled = s.pulledAt && s.pulledAt.get(head.pull);
  if (!p || !pulled) return;
  s.pulledAt.delete(head.pull);
  const stale = s.panels.travel && s.panels.travel.value !== head.seq ? 1 : 0;
  const rows = (window.__kvscope_profile ||= []);
  rows.push([pulled, p.start, p.view || 0, p.panels || 0, p.frame || 0, p.delta || 0, p.encode || 0, p.sent, arrived, received,
    ...browser, Date.now(), head.seq, stale]);
  if (rows.length > 20000) rows.splice(0, 10000);
}

function schedulePull(s, interval) {
  if (s.pullTimer) return;
  const wait = s.lastPull + interval - performance.now();
  if (wait <= 0) pull(s);  // now: Python makes the next frame while this one is drawn
  else s.pullTimer = setTimeout(() => pull(s), wait);
}

async function receive(s, bytes, arrived) {
  s.lastMsg = performance.now();
  if (s.hooks) {  // for the bench: when each frame came, and its size
    const msgs = (window.__kvscope_msgs ||= []);
    msgs.push([Date.now(), bytes.length]);
    if (msgs.length > 20000) msgs.splice(0, 10000);
  }
  try {
    const t0 = performance.now(), received = Date.now();
    const frame = await parse(bytes), head = frame.head;
    if ("lane" in head) useLane(s, head.lane);  // a rerun's frame says where the lane is, and if it redraws
    // a frame of an older rerun's lane, or one of the live engine older than the frame held (a
    // rerun's, overtaken by the lane's), is not drawn: the page never steps back
    const old = head.gen < s.gen || (head.gen === s.gen && head.live && s.data && s.data.live && head.seq < s.data.seq);
    s.gen = Math.max(s.gen, head.gen || 0);
    const t1 = performance.now();
    const applied = !old && apply(s, frame);
    // ask for the next frame before drawing this one (the ask names this frame, which it holds
    // now): Python's redraw and the browser's drawing overlap
    schedulePull(s, frame.head.interval || 100);
    if (applied) {  // every live view of this frame's redraw, then the grid: one step, one moment
      const t2 = performance.now();
      renderPanels(s, frame.head);
      const t3 = performance.now();
      draw(s);
      if (s.hooks) profile(s, frame.head, arrived, received, [t1 - t0, t2 - t1, t3 - t2, performance.now() - t3]);
      s.err.style.display = "none";
    }
  } catch (e) {
    s.err.textContent = `The grid could not draw this frame: ${e}`;
    s.err.style.display = "block";
    console.error(e);
    schedulePull(s, 1000);
  }
}

// For tests: blocks whose state (0-3) or latest-step touch kind matches, and where block i
// is on screen once the zoomed view shows it (client coordinates of its cell's centre).
function testApi(s) {
  return {
    find(what, most = 1) {
      const code = s.style.touchKinds.indexOf(what) + 1, out = [];
      for (let i = 0; i < s.data.n && out.length < most; i++) if (code ? touch(s.dev, i) === code : state(s.dev, i) === what) out.push(i);
      return out;
    },
    group(i) { return group(s.dev, i); },
    state(i) { return state(s.dev, i); },
    tip() { return s.tip.style.display === "block" ? s.tip.innerText : ""; },
    lane() { return s.lane ? { open: s.lane.open, ready: s.lane.ws.readyState === WebSocket.OPEN } : null; },
    // pixels differing between what the canvases show and a paint from scratch (overview, main, host)
    keptPixelsDiffer() {
      const canvases = [s.over, s.canvas, s.hostCanvas];
      const grab = () => canvases.map((c) => (c.width && c.height ? c.getContext("2d").getImageData(0, 0, c.width, c.height).data : null));
      const kept = grab();
      for (const c of canvases) c.__pixels = null;
      draw(s);
      return grab().map((fresh, k) => {
        let n = 0;
        if (fresh) for (let i = 0; i < fresh.length; i += 4) n += fresh[i] !== kept[k][i] || fresh[i + 1] !== kept[k][i + 1] || fresh[i + 2] !== kept[k][i + 2];
        return n;
      });
    },
    locate(i) {
      if (i < s.range.start || i >= s.range.start + s.range.count) setRange(s, i - s.range.count / 2, s.range.count);
      const [x, y, c] = place(s.geo, i), r = s.canvas.getBoundingClientRect();
      return { x: r.left + x + c / 2, y: r.top + y + c / 2 };
    },
  };
}

export default function (component) {
  const { data, parentElement, setStateValue, setTriggerValue } = component;
  const root = parentElement.querySelector(".kv");
  if (!root || !data) return;
  const s = root.__kv || (root.__kv = setup(root));
  if (s.style && !R) layout(s.style);  // this script re-ran over a mounted grid (the style is not sent again)
  if (s.hooks) window.__kvscope_grid_api = testApi(s);
  s.setState = setStateValue;
  s.setTrigger = setTriggerValue;
  if (data === s.lastBytes) return;
  s.lastBytes = data;
  const bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
  const arrived = Date.now();  // Streamlit hands it over (for the bench: then it waits its turn)
  s.queue = s.queue.then(() => receive(s, bytes, arrived));  // frames apply in the order they came
}

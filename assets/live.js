// KVScope live views around the pool grid (assets/grid.js, concatenated after this file into one
// component): the status line, the key event banner, the metrics, the time-travel bar, what
// paging saves and the block tables. Python (app/panels/grid.py `show`) sends their data in the
// grid's frame header (`panels`), every panel from one Redraw; grid.js calls `renderPanels` and
// draws the canvas in the same step, so the page never shows two redraws at once. A panel left
// out of a frame is unchanged since a frame this browser holds.

const COLORS = ["red", "orange", "green", "blue", "violet", "gray"];
// Streamlit's own icons (its Material Symbols font, served with the page): never a request elsewhere
const icon = (name) => `<span class="ms" aria-hidden="true">${name}</span>`;

function setupPanels(s, root) {
  const cols = el("div", "cols", root), left = el("div", "left", cols), right = el("div", "right", cols);
  s.p = {
    status: el("div", "status", left), banner: el("div", "banner", left), metrics: el("div", "metrics", left),
    groups: el("div", "since kvgroups", left), since: el("div", "since", left), travel: el("div", "travel", left),
  };
  const box = el("div", "gridbox", left);
  s.p.card = el("div", "card", left);
  s.p.metrics.addEventListener("click", (ev) => { if (ev.target.closest("[data-why]")) s.setTrigger("why", Date.now()); });
  setupTravel(s, s.p.travel);
  setupTables(s, el("div", "tables", right));
  s.panels = {};
  return box;
}

function renderPanels(s, head) {
  const p = head.panels;
  if (!p) return;
  for (const name of Object.keys(p)) {  // a panel that failed on the server says so in its place
    const failed = p[name] && typeof p[name] === "object" && "error" in p[name];
    const slot = s.p[name] || s.tables.box, box = name === "tables" ? s.tables.box : slot;
    let note = box.previousElementSibling;
    if (!note || !note.classList.contains("perr")) { note = el("div", "perr"); box.before(note); }
    note.textContent = failed ? p[name].error : "";
    note.style.display = failed ? "" : "none";
    box.style.display = failed ? "none" : "";
    if (failed) delete p[name];
  }
  const html = (node, value) => { if (node.__html !== value) { node.innerHTML = value; node.__html = value; } };
  if ("status" in p) html(s.p.status, p.status);
  if ("banner" in p) { html(s.p.banner, p.banner); s.p.banner.style.display = p.banner ? "" : "none"; }
  if ("metrics" in p) {
    html(s.p.metrics, p.metrics.cards.map(metricCard).join(""));
    html(s.p.groups, p.metrics.groups || "");
    s.p.groups.title = p.metrics.groupsHelp || "";
    s.p.groups.style.display = p.metrics.groups ? "" : "none";
    html(s.p.since, p.metrics.since);
    s.p.since.style.display = p.metrics.since ? "" : "none";
  }
  if ("travel" in p) renderTravel(s, p.travel);
  if ("card" in p) html(s.p.card, p.card);
  if ("tables" in p) renderTables(s, p.tables);
  Object.assign(s.panels, p);
}

function metricCard(m) {
  const color = COLORS.includes(m.color) ? m.color : "gray";
  return `<div class="metric" data-label="${esc(m.label)}"><div class="mlabel" title="${esc(m.help)}">${esc(m.label)}` +
    ' <span class="help">ⓘ</span></div>' +
    `<div class="mvalue">${esc(m.value)}</div><div class="mdelta c-${color}">${esc(m.delta)}</div>` +
    (m.note ? `<div class="mnote" title="${esc(m.noteHelp || "")}">${m.note}</div>` : "") +
    (m.button ? `<button class="mbtn" data-why="1" title="${esc(m.button[1])}">${icon("troubleshoot")}${esc(m.button[0])}</button>` : "") +
    "</div>";
}

// ------------------------------------------------------------------ time travel
// A track over the retained event numbers with the viewed event's handle and ticks at the
// timeline's markers, the step and event buttons, and the line that says where the views are.
// Every move goes to Python as a one-shot trigger ("travel"): a redraw can never read as a move.
function setupTravel(s, box) {
  box.innerHTML = '<div class="scrub" tabindex="0"><div class="track"><div class="fill"></div><div class="ticks"></div>' +
    '<div class="handle"></div></div><div class="label"></div></div>' +
    `<div class="tbtns"><button data-move="prev_step" title="End of the previous engine step">${icon("skip_previous")}Step</button>` +
    `<button data-move="prev" title="Previous event">${icon("chevron_left")}Event</button>` +
    `<button data-move="next" title="Next event">Event${icon("chevron_right")}</button>` +
    `<button data-move="next_step" title="End of the next engine step">Step${icon("skip_next")}</button>` +
    `<button data-move="live" class="golive">${icon("radio_button_checked")}Live</button></div><div class="tcap"></div>`;
  const t = (s.travel = { box, dragging: false, preview: null, data: null });
  t.scrub = box.querySelector(".scrub");
  t.track = box.querySelector(".track");
  t.fill = box.querySelector(".fill");
  t.ticks = box.querySelector(".ticks");
  t.handle = box.querySelector(".handle");
  t.label = box.querySelector(".label");
  t.cap = box.querySelector(".tcap");
  t.live = box.querySelector(".golive");
  const at = (ev) => {
    const r = t.track.getBoundingClientRect(), d = t.data;
    const f = Math.min(1, Math.max(0, (ev.clientX - r.left) / r.width));
    return Math.round(d.first + f * (d.last - d.first));
  };
  const send = (n) => s.setTrigger("travel", { to: n >= t.data.last ? -1 : Math.max(t.data.first, n) });  // -1: live
  t.track.addEventListener("pointerdown", (ev) => {
    t.dragging = true; t.track.setPointerCapture(ev.pointerId); t.preview = at(ev); paintScrub(t);
  });
  t.track.addEventListener("pointermove", (ev) => { if (t.dragging) { t.preview = at(ev); paintScrub(t); } });
  t.track.addEventListener("pointerup", (ev) => {
    if (!t.dragging) return;
    t.dragging = false; const n = at(ev); t.preview = n; paintScrub(t); send(n);
  });
  t.scrub.addEventListener("keydown", (ev) => {
    const d = t.data, cur = t.preview ?? d.value, step = ev.shiftKey ? 100 : 1;
    if (ev.key === "ArrowLeft") { t.preview = Math.max(d.first, cur - step); send(t.preview); ev.preventDefault(); }
    if (ev.key === "ArrowRight") { t.preview = Math.min(d.last, cur + step); send(t.preview); ev.preventDefault(); }
    if (ev.key === "End") { t.preview = d.last; send(d.last); ev.preventDefault(); }
    paintScrub(t);
  });
  box.querySelector(".tbtns").addEventListener("click", (ev) => {
    const b = ev.target.closest("button");
    if (b && !b.disabled && t.data) s.setTrigger("travel", { move: b.dataset.move, at: t.data.value });
  });
}

function renderTravel(s, d) {
  const t = s.travel;
  t.box.style.display = d ? "" : "none";
  if (!d) return;
  // a new value from Python ends any preview, unless the user is still dragging
  if (!t.dragging && (!t.data || t.data.value !== d.value || t.data.live !== d.live)) t.preview = null;
  t.data = d;
  const span = Math.max(1, d.last - d.first);
  const ticks = d.markers.map(([n, color, title]) =>
    `<i style="left:${(100 * (n - d.first)) / span}%;background:${color}" title="${esc(title)}"></i>`).join("");
  if (t.ticks.__html !== ticks) { t.ticks.innerHTML = ticks; t.ticks.__html = ticks; }
  t.cap.innerHTML = d.caption;
  t.live.disabled = d.live;
  t.live.classList.toggle("primary", !d.live);
  paintScrub(t);
}

function paintScrub(t) {
  const d = t.data, span = Math.max(1, d.last - d.first);
  const moving = t.dragging || t.preview != null, v = moving ? t.preview ?? d.value : d.value;
  const f = (v - d.first) / span;
  t.handle.style.left = `${100 * f}%`;
  t.fill.style.width = `${100 * f}%`;
  t.scrub.classList.toggle("live", d.live && !moving);
  t.label.textContent = d.live && !moving ? `live · event ${fmt(d.value)}` : `event ${fmt(v)} of ${fmt(d.last)}`;
}

// ------------------------------------------------------------------ block tables
// Search, order and open runs are this element's `tables` state (Python answers with the cards
// and the list); a row of the list clicked pins its card (`pin` trigger).
const ROW_H = 24;

function setupTables(s, box) {
  box.innerHTML = '<div class="tabs"><button data-tab="tables">Block tables</button><button data-tab="finished">Finished requests</button></div>' +
    '<div class="tab-tables"><div class="controls"><input type="search" class="q" placeholder="Find a sequence, e.g. r12 or sys1" ' +
    'aria-label="Find a sequence"><select class="sort" aria-label="Order" title="blocks held: most first · age: oldest first · ' +
    'status: running, swapped, waiting"></select><label class="open" title="List the blocks of each run of consecutive blocks">' +
    '<input type="checkbox"> Open runs</label></div><label class="every" title="A row per KV-cache group. Off: ' +
    'groups of one kind whose tables look alike (the same entries empty, shared, hit or copied) share a row, ×n">' +
    '<input type="checkbox"> Every KV-cache group</label><div class="tcaption"></div><div class="cards"></div>' +
    '<div class="list"><div class="lhead"></div><div class="lbody"><div class="lspace"></div><div class="lrows"></div></div>' +
    '<div class="lmore"></div></div></div><div class="tab-finished"></div>';
  const t = (s.tables = { box, data: null, controls: null, timer: null });
  for (const name of ["q", "sort", "tcaption", "cards", "list", "lhead", "lbody", "lspace", "lrows", "lmore"]) t[name] = box.querySelector(`.${name}`);
  t.open = box.querySelector(".open input");
  t.every = box.querySelector(".every input");
  t.everyBox = box.querySelector(".every");
  t.finished = box.querySelector(".tab-finished");
  t.main = box.querySelector(".tab-tables");
  const say = () => s.setState("tables", { ...t.controls });
  t.q.addEventListener("input", () => {
    t.controls.query = t.q.value;
    clearTimeout(t.timer);
    t.timer = setTimeout(say, 250);  // one rerun per pause in the typing
  });
  t.sort.addEventListener("change", () => { t.controls.sort = t.sort.value; say(); });
  t.open.addEventListener("change", () => { t.controls.open = t.open.checked; say(); });
  t.every.addEventListener("change", () => { t.controls.groups = t.every.checked; say(); });
  box.querySelector(".tabs").addEventListener("click", (ev) => {
    const b = ev.target.closest("button");
    if (!b) return;
    t.controls.tab = b.dataset.tab;
    showTab(t);
    say();
  });
  // the list's scroll and height, read where layout is fresh, not when the rows are painted
  t.lbody.addEventListener("scroll", () => { t.top = t.lbody.scrollTop; paintRows(t); });
  new ResizeObserver(() => { t.height = t.lbody.clientHeight; paintRows(t); }).observe(t.lbody);
  t.lrows.addEventListener("click", (ev) => {
    const row = ev.target.closest("[data-seq]");
    if (row) s.setTrigger("pin", row.dataset.seq);
  });
}

function showTab(t) {
  const fin = t.controls.tab === "finished";
  t.main.style.display = fin ? "none" : "";
  t.finished.style.display = fin ? "" : "none";
  for (const b of t.box.querySelectorAll(".tabs button")) b.classList.toggle("on", b.dataset.tab === t.controls.tab);
}

function renderTables(s, d) {
  const t = s.tables;
  if (!t.controls) {  // the controls are the user's from here on; Python's values only start them
    t.controls = { ...d.controls };
    t.sort.innerHTML = d.sorts.map((k) => `<option value="${esc(k)}">${esc(k)}</option>`).join("");
    t.q.value = t.controls.query;
    t.sort.value = t.controls.sort;
    t.open.checked = t.controls.open;
    t.every.checked = t.controls.groups;
    showTab(t);
  }
  t.data = d;
  t.everyBox.style.display = d.hybrid ? "" : "none";  // a hybrid pool's tables: a row per group, or alike
  t.tcaption.textContent = d.caption;
  if (t.cards.__html !== d.cards) { t.cards.innerHTML = d.cards; t.cards.__html = d.cards; }
  t.cards.classList.toggle("few", !d.rows);
  if (t.finished.__html !== d.finished) { t.finished.innerHTML = d.finished; t.finished.__html = d.finished; }
  t.list.style.display = d.rows ? "" : "none";
  if (!d.rows) return;
  t.lhead.innerHTML = d.columns.map((c) => `<span>${esc(c)}</span>`).join("");
  t.lspace.style.height = `${d.rows.length * ROW_H}px`;
  t.lmore.textContent = d.more ? `and ${fmt(d.more)} more: search to narrow the list` : "";
  paintRows(t);
}

function paintRows(t) {  // only the rows in sight: the list may hold a thousand
  const d = t.data;
  if (!d || !d.rows) return;
  const first = Math.max(0, Math.floor((t.top || 0) / ROW_H) - 5);
  const last = Math.min(d.rows.length, first + Math.ceil((t.height ?? t.lbody.clientHeight) / ROW_H) + 10);
  let html = "";
  for (let i = first; i < last; i++) {
    const r = d.rows[i];
    html += `<div class="lrow${r[0] === d.pinned ? " pin" : ""}" data-seq="${esc(r[0])}" style="top:${i * ROW_H}px">` +
      r.map((v) => `<span>${v === null ? "" : esc(typeof v === "number" ? fmt(v) : v)}</span>`).join("") + "</div>";
  }
  t.lrows.innerHTML = html;
}

// KVScope time-travel scrubber: a track over the retained event numbers with the viewed event's
// handle and ticks at preemptions, swaps and resets. Drag (or click, or use the arrow keys) to
// choose an event; the choice goes to Python as a one-shot trigger, so a redraw from Python can
// never be mistaken for a user's move. Dropping at the right end returns to live.

function setup(root, set) {
  const s = { root, dragging: false, set };
  root.tabIndex = 0;
  s.track = root.querySelector(".track");
  s.fill = root.querySelector(".fill");
  s.ticks = root.querySelector(".ticks");
  s.handle = root.querySelector(".handle");
  s.label = root.querySelector(".label");
  const at = (ev) => {
    const r = s.track.getBoundingClientRect(), d = s.data;
    const f = Math.min(1, Math.max(0, (ev.clientX - r.left) / r.width));
    return Math.round(d.first + f * (d.last - d.first));
  };
  const send = (n) => {
    const d = s.data;
    s.set("travel", n >= d.last ? -1 : Math.max(d.first, n)); // -1: live
  };
  s.track.addEventListener("pointerdown", (ev) => {
    s.dragging = true; s.track.setPointerCapture(ev.pointerId); s.preview = at(ev); paint(s);
  });
  s.track.addEventListener("pointermove", (ev) => { if (s.dragging) { s.preview = at(ev); paint(s); } });
  s.track.addEventListener("pointerup", (ev) => {
    if (!s.dragging) return;
    s.dragging = false; const n = at(ev); s.preview = n; paint(s); send(n);
  });
  root.addEventListener("keydown", (ev) => {
    const d = s.data, cur = s.preview ?? d.value;
    const step = ev.shiftKey ? 100 : 1;
    if (ev.key === "ArrowLeft") { s.preview = Math.max(d.first, cur - step); send(s.preview); ev.preventDefault(); }
    if (ev.key === "ArrowRight") { s.preview = Math.min(d.last, cur + step); send(s.preview); ev.preventDefault(); }
    if (ev.key === "End") { s.preview = d.last; send(d.last); ev.preventDefault(); }
    paint(s);
  });
  return s;
}

function paint(s) {
  const d = s.data, span = Math.max(1, d.last - d.first);
  const v = s.dragging || s.preview != null ? s.preview ?? d.value : d.value;
  const f = (v - d.first) / span;
  s.handle.style.left = `${100 * f}%`;
  s.fill.style.width = `${100 * f}%`;
  s.root.classList.toggle("live", d.live && !s.dragging && s.preview == null);
  s.label.textContent = d.live && !s.dragging && s.preview == null ? `live · event ${d.last.toLocaleString()}`
    : `event ${v.toLocaleString()} of ${d.last.toLocaleString()}`;
}

export default function (component) {
  const { data, parentElement, setTriggerValue } = component;
  const root = parentElement.querySelector(".scrub");
  if (!root || !data) return;
  const s = root.__kv || (root.__kv = setup(root, setTriggerValue));
  s.set = setTriggerValue;
  // a new value from Python ends any preview, unless the user is still dragging
  if (!s.dragging && (!s.data || s.data.value !== data.value || s.data.live !== data.live)) s.preview = null;
  s.data = data;
  const span = Math.max(1, data.last - data.first);
  s.ticks.innerHTML = data.markers.map(([n, color, title]) =>
    `<i style="left:${(100 * (n - data.first)) / span}%;background:${color}" title="${title}"></i>`).join("");
  paint(s);
}

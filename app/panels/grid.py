"""The pool grid at any size: an overview of every block and a zoomed region with the full
per-block detail, drawn on canvases by a components.v2 component (assets/grid.js).

The server builds a *frame* per view: a column per field of a block's drawing (holder key
when the block has one holder, the first 32 bits of its hash, ref count, tokens held, state,
latest-step touch, KV-cache group; 15 bytes per device block, 8 per host block), plus the live
sequences by key; the wire carries them as records (16 bytes per device block). Frames are
kept, by token, in a store shared by every session. The browser holds the last frame it got
and asks for the next (its `sync`: the token it holds and the block under the pointer) before
drawing it, by the element's lane (app/panels/lane.py) or through a Streamlit rerun; the answer
is a delta from exactly that frame (the blocks whose drawing changed), or the whole frame,
compressed, when the server no longer knows it. So a redraw costs what changed, not the size
of the pool, on the server and in the browser alike.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, TypeVar

import numpy as np
import streamlit as st

from kvscope_contract import protocol as p
from kvscope_contract.kinds import KINDS, TOUCH_KINDS, touched_blocks
from kvscope_contract.state import CACHED as CACHED_STATE, SHARED as SHARED_STATE, STATE_NAMES, USED
from app.link.client import View
from app.history.groups import group_label
from app.link.source import ASSETS
from app.streamlit_argv import TEST_HOOKS
from app.ui.palette import ACCENT, CACHED, FREE, INK, RESERVED, SEQ_COLORS, SHARED, css_vars, group_colors

T = TypeVar("T")
_CODE = {k: i + 1 for i, k in enumerate(TOUCH_KINDS)}  # touch code sent to the canvas: 1 + index
DEV = np.dtype([("owner", "<u4"), ("hash", "<u4"), ("ref", "<u2"), ("tokens", "<u2"),
                ("state", "u1"), ("touch", "u1"), ("group", "u1"), ("pad", "u1")])
HOST = np.dtype([("owner", "<u4"), ("tokens", "<u2"), ("touch", "u1"), ("ref", "u1")])
# a block of the host tier (protocol 3, docs/offload.md): the first 32 bits of the hash it holds (0:
# free), what the latest step did to it (TIER_TOUCH's index + 1) and whether it holds content; sent
# whole with every frame (a tier is small beside the device pool)
TIER = np.dtype([("hash", "<u4"), ("touch", "u1"), ("held", "u1"), ("pad", "<u2")])
TIER_TOUCH = ("offload_store", "offload_load", "offload_evict")
MAGIC = b"KVG1"
COMPRESS_ABOVE = 256 * 1024  # whole frames larger than this go deflated


_BY_TYPE = {t: _CODE[t.__struct_config__.tag] for t in p.AnyEvent.__args__ if t.__struct_config__.tag in _CODE}
_ONE_BLOCK = (p.Alloc, p.Free, p.PrefixHit, p.Evict)


def touched(events: list[p.AnyEvent]) -> tuple[dict[int, int], dict[int, int]]:
    """Device and host blocks touched by `events`: block -> touch code (1 + TOUCH_KINDS index),
    the most telling kind winning when a block saw several."""
    dev, host, _ = step_touches(events)
    return dev, host


def step_touches(events: list[p.AnyEvent]) -> tuple[dict[int, int], dict[int, int], Counter]:
    """`touched`, and how many events of each touching kind there were."""
    dev: dict[int, int] = {}
    host: dict[int, int] = {}
    kinds: Counter = Counter()
    for ev in events:
        code = _BY_TYPE.get(type(ev))
        if code is None:
            continue
        kinds[code] += 1
        if type(ev) in _ONE_BLOCK:  # most of a step: one block each
            b = ev.block_id
            if dev.get(b, 0) < code:
                dev[b] = code
            continue
        for where, blocks in zip((dev, host), touched_blocks(ev)):
            for b in blocks:
                if where.get(b, 0) < code:
                    where[b] = code
    return dev, host, Counter({TOUCH_KINDS[c - 1]: n for c, n in kinds.items()})


def _touch_column(size: int, touch: dict[int, int]) -> np.ndarray:
    col = np.zeros(size, np.uint8)
    if touch:
        ids = np.fromiter(touch, np.int64, len(touch))
        codes = np.fromiter(touch.values(), np.uint8, len(touch))
        keep = (ids >= 0) & (ids < size)  # a step's events may name blocks of a pool since reset
        col[ids[keep]] = codes[keep]
    return col


class Columns(dict):
    """A frame's blocks as contiguous columns by field of `record`: built, compared and kept
    column by column (a million records' strided fields cost several times more), made
    records only for what goes on the wire."""

    def __init__(self, record: np.dtype, **columns: np.ndarray):
        super().__init__(columns)
        self.record = record

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.values())

    def records(self, ids: np.ndarray | None = None) -> np.ndarray:
        """The blocks `ids` (None: all) as `record`s, as the canvas reads them."""
        out = np.zeros(len(next(iter(self.values()))) if ids is None else len(ids), self.record)
        for name, column in self.items():
            out[name] = column if ids is None else column[ids]
        return out

    def changed(self, old: Columns) -> np.ndarray:
        """The blocks whose drawing differs from `old`'s (a pool may have none)."""
        diff = np.zeros(len(next(iter(self.values()))), bool)
        for name, column in self.items():
            diff |= column != old[name]
        return np.flatnonzero(diff).astype("<u4")


@dataclass(eq=False)
class Frame:
    """What the canvas draws for one view."""
    token: int
    shape: tuple[int, int, int]  # device blocks, host blocks, block size
    dev: Columns                 # DEV's fields per device block
    host: Columns                # HOST's fields per host block
    seqs: dict[int, list]        # key -> [seq_id, colour index, status]
    info: dict                   # event number, live, step, counts, what the step touched
    tier: np.ndarray = None      # TIER records of the host tier's blocks (none without a tier)

    @property
    def nbytes(self) -> int:
        return self.dev.nbytes + self.host.nbytes + self.tier.nbytes


_tokens = itertools.count(1)


def build(view: View, colors: dict[str, int]) -> Frame:
    """The frame of `view`: every block's drawing, vectorised over the reducer's columns."""
    pool, cfg = view.mirror.state, view.mirror.config
    n, m = len(pool.ref_counts), len(pool.host_ref_counts)
    ref, host_ref, states = pool.ref_counts, pool.host_ref_counts, view.block_states()
    dev_touch, host_touch, events = step_touches(view.step_events)
    dev = Columns(DEV, owner=np.where(ref == 1, pool.holder, 0).view("<u4"), hash=pool.hash32.copy(),
                  ref=np.minimum(ref, 0xFFFF).astype("<u2"), tokens=pool.tokens.copy(), state=states,
                  touch=_touch_column(n, dev_touch), group=pool.kv_group.copy())
    host = Columns(HOST, owner=np.where(host_ref == 1, pool.host_holder, 0).view("<u4"),  # shared: no single owner
                   tokens=pool.host_tokens.copy(), touch=_touch_column(m, host_touch),
                   ref=np.minimum(host_ref, 0xFF).astype("u1"))
    palette = len(SEQ_COLORS)
    seqs = {s.key: [s.seq_id, colors.get(s.seq_id, s.key) % palette, s.status] for s in pool.seqs.values()}
    blocks = Counter(TOUCH_KINDS[c - 1] for c in itertools.chain(dev_touch.values(), host_touch.values()))
    last = view.step_events[-1] if view.step_events else None
    info = {"seq": view.event, "live": view.live, "step": last.step if last else 0,
            "counts": pool.counts(states)._asdict(),
            "touched": {k: [events[k], blocks[k]] for k in TOUCH_KINDS if blocks[k] or events[k]}}
    if len(cfg.groups) > 1:  # a hybrid pool: each group's name, colour and blocks, for the hover and "colour by group"
        info["groups"] = group_legend(pool, states)
    tier = tier_records(pool, view.step_events)
    info["tier"] = {"blocks": len(tier), "held": int(tier["held"].sum())}
    return Frame(next(_tokens), (n, m, cfg.block_size), dev, host, seqs, info, tier)


def tier_records(pool, step_events) -> np.ndarray:
    """The host tier's blocks as TIER records: the hash each holds, and what the step did to it
    (a block evicted and stored again in one step shows its store)."""
    out = np.zeros(len(pool.offload_has), TIER)
    out["held"] = pool.offload_has
    out["hash"] = pool.offload_hash64.view("<u4")[1::2] if len(out) else 0
    for ev in step_events:
        if (kind := ev.__struct_config__.tag) in TIER_TOUCH and 0 <= ev.offload_block_id < len(out):
            out["touch"][ev.offload_block_id] = TIER_TOUCH.index(kind) + 1
    return out


def group_legend(pool, states: np.ndarray) -> list[list]:
    """[name, colour, used blocks, cached blocks] per KV-cache group."""
    n = len(pool.config.groups)
    used = np.bincount(pool.kv_group[(states == USED) | (states == SHARED_STATE)], minlength=n)
    cached = np.bincount(pool.kv_group[states == CACHED_STATE], minlength=n)
    colors = group_colors(pool.config.groups)
    return [[group_label(g, pool.config.groups), colors[g], int(used[g]), int(cached[g])] for g in range(n)]


class FrameStore:
    """Frames by token, newest last, bounded in count and bytes: the bases of deltas."""

    def __init__(self, max_frames: int = 48, max_bytes: int = 256 << 20):
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.frames: OrderedDict[int, Frame] = OrderedDict()
        self.nbytes = 0
        self.lock = threading.Lock()

    def add(self, frame: Frame) -> None:
        with self.lock:
            self.frames[frame.token] = frame
            self.nbytes += frame.nbytes
            while len(self.frames) > 1 and (len(self.frames) > self.max_frames or self.nbytes > self.max_bytes):
                self.nbytes -= self.frames.popitem(last=False)[1].nbytes

    def get(self, token) -> Frame | None:
        with self.lock:
            f = self.frames.get(token) if isinstance(token, int) else None
            if f is not None:
                self.frames.move_to_end(token)
            return f


FRAMES = FrameStore()


def frame_of(view: View, colors: dict[str, int]) -> Frame:
    """The view's frame, built once and shared by every session drawing it."""
    f = view.memo.get("grid_frame")
    if f is None:
        f = view.memo["grid_frame"] = build(view, colors)
        FRAMES.add(f)
    return f


def _union(parts) -> np.ndarray:
    parts = list(parts)
    return parts[0] if len(parts) == 1 else np.union1d(parts[0], np.concatenate(parts[1:])).astype("<u4")


def _align(buf: bytearray, to: int = 16) -> None:
    buf.extend(b"\0" * (-len(buf) % to))


class Profile:
    """Where a redraw's time goes on the server, for the bench (docs/benchmarks.md): milliseconds
    per leg, sent in the frame's header (`prof`) when the app runs with its test hooks on."""

    def __init__(self):
        self.on = os.environ.get(TEST_HOOKS) == "1"
        self.legs: dict[str, float] = {"start": time.time() * 1000}

    def timed(self, leg: str, work: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        out = work()
        self.legs[leg] = self.legs.get(leg, 0.0) + (time.perf_counter() - t0) * 1000
        return out


def message(frame: Frame, base: Frame | None, extra: dict | None = None, also: list[Frame] = (),
            prof: Profile | None = None) -> bytes:
    """The bytes the canvas gets: a delta from `base` when it has the frame's shape, else the
    whole frame. `also`: other frames the canvas may hold instead of `base` (sent after it, not
    yet acknowledged): the delta then carries every block that differs from any of them, so it
    applies to each (`bases`), and the grid never stays behind the views drawn with it.
    Layout: MAGIC, u32 header length, header JSON, then 16-byte aligned parts that the header
    locates ([offset, count] from the start of the body)."""
    t_message = time.perf_counter()
    head = {**frame.info, **(extra or {}), "token": frame.token, "n": frame.shape[0],
            "m": frame.shape[1], "bs": frame.shape[2], "o": len(frame.tier)}
    body, parts = bytearray(), {}

    def part(name: str, arr: np.ndarray) -> None:
        parts[name] = [len(body), len(arr)]
        body.extend(arr.tobytes())
        _align(body)

    bases = [base, *(a for a in also if a is not base)] if base is not None else []
    if bases and all(b.shape == frame.shape for b in bases):
        # a browser that holds this very frame (sent before, not yet acknowledged) takes it too:
        # the blocks and sequences it carries are the frame's own
        head |= {"kind": "delta", "base": base.token,
                 "bases": list(dict.fromkeys([b.token for b in bases] + [frame.token])),
                 "gone": sorted({k for b in bases for k in b.seqs if k not in frame.seqs}),
                 "seqs": [[k, *v] for k, v in frame.seqs.items() if any(b.seqs.get(k) != v for b in bases)]}
        if any(b is not frame for b in bases):
            d = _union(frame.dev.changed(b.dev) for b in bases)
            h = _union(frame.host.changed(b.host) for b in bases)
            part("devIdx", d)
            part("dev", frame.dev.records(d))
            part("hostIdx", h)
            part("host", frame.host.records(h))
    else:
        head |= {"kind": "full", "seqs": [[k, *v] for k, v in frame.seqs.items()]}
        part("dev", frame.dev.records())
        part("host", frame.host.records())
    if len(frame.tier):
        part("tier", frame.tier)
    if prof is not None:
        t_delta = time.perf_counter()
    if len(body) > COMPRESS_ABOVE:
        body, head["deflated"] = bytearray(zlib.compress(bytes(body), 1)), True
    head["parts"] = parts
    if prof is not None and prof.on:
        prof.legs["delta"] = (t_delta - t_message) * 1000
        prof.legs["encode"] = (time.perf_counter() - t_delta) * 1000
        head["prof"] = {**prof.legs, "sent": time.time() * 1000}
    header = json.dumps(head, separators=(",", ":")).encode()
    out = bytearray(MAGIC + len(header).to_bytes(4, "little") + header)
    _align(out)
    return bytes(out + body)


def read(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """A message taken apart again, as the canvas does: (header, parts as arrays)."""
    if data[:4] != MAGIC:
        raise ValueError("not a grid message")
    size = int.from_bytes(data[4:8], "little")
    head = json.loads(data[8:8 + size])
    body = data[-(-(8 + size) // 16) * 16:]
    if head.get("deflated"):
        body = zlib.decompress(body)
    kinds = {"dev": DEV, "host": HOST, "devIdx": np.dtype("<u4"), "hostIdx": np.dtype("<u4"), "tier": TIER}
    return head, {k: np.frombuffer(body, kinds[k], n, off) for k, (off, n) in head["parts"].items()}


# ------------------------------------------------------------------------------- hover
def focus(view: View, block: int, host: bool, colors: dict[str, int]) -> dict | None:
    """The block under the pointer, said in full: its holders (in the table of its KV-cache
    group) and the start of its text. Computed once per view and block."""
    key = ("grid_focus", block, host)
    if key in view.memo:
        return view.memo[key]
    pool, palette = view.mirror.state, len(SEQ_COLORS)
    size = len(pool.host_ref_counts) if host else len(pool.ref_counts)
    if not 0 <= block < size:
        return None
    if host:  # a host block mirrors a device block of one group: find which
        found = [(s.seq_id, g, t.index(block)) for s in pool.seqs.values()
                 for g, t in enumerate(s.host_tables) if block in t]
        group = found[0][1] if found else 0
        holders = [(sid, i) for sid, g, i in found if g == group]
    else:
        group = int(pool.kv_group[block])
        holders = [(s.seq_id, t.index(block)) for s in pool.seqs.values()
                   if group < len(s.block_tables) and block in (t := s.block_tables[group])]
    texts = view.mirror.texts
    text = (texts.text(*holders[0]) if holders else None) if host else texts.of_block(pool, block, holders)
    out = {"b": block, "host": host, "text": text,
           "holders": [[sid, colors.get(sid, 0) % palette, i] for sid, i in holders[:64]],
           "more": max(0, len(holders) - 64), "group": group}
    view.memo[key] = out
    return out


# ------------------------------------------------------------------------------- streamlit
MAX_BASES = 8  # frames sent but not yet acknowledged that a delta still applies to


def _layout(record: np.dtype) -> dict[str, int]:
    """A record's size and its fields' byte offsets, as grid.js reads them."""
    return {"size": record.itemsize, **{name: record.fields[name][1] for name in record.names if name != "pad"}}


STYLE = {"palette": list(SEQ_COLORS), "free": FREE, "cached": CACHED, "shared": SHARED, "reserved": RESERVED,
         "accent": ACCENT, "ink": INK, "record": {"dev": _layout(DEV), "host": _layout(HOST), "tier": _layout(TIER)},
         "tierTouch": [KINDS[k].color for k in TIER_TOUCH], "tierLabels": [KINDS[k].label for k in TIER_TOUCH],
         "states": {name: code for code, name in enumerate(STATE_NAMES)},
         "touch": [KINDS[k].color for k in TOUCH_KINDS], "touchKinds": list(TOUCH_KINDS),
         "touchLabels": [KINDS[k].label for k in TOUCH_KINDS]}


def _html() -> str:
    """The grid's element; with KVSCOPE_TEST_HOOKS=1 in the app's environment (tools/launch.py
    sets it for the browser tests, the screenshots and the benches) the script also publishes
    what it drew for them (window.__kvscope_grid, __kvscope_draws, __kvscope_msgs,
    __kvscope_grid_api)."""
    return '<div class="kv" data-test-hooks></div>' if os.environ.get(TEST_HOOKS) == "1" else '<div class="kv"></div>'


@lru_cache(maxsize=1)
def _component():
    # the live views around the grid (assets/live.js) and the grid (assets/grid.js): one script, one
    # element, in the page itself (no shadow root: the browser's find and the page's text include it;
    # the stylesheets hold to .kv)
    return st.components.v2.component(
        "kvscope_grid", html=_html(), isolate_styles=False,
        css=css_vars(".kv") + (ASSETS / "live.css").read_text() + (ASSETS / "grid.css").read_text(),
        js=(ASSETS / "live.js").read_text() + (ASSETS / "grid.js").read_text())


def _sync(key: str) -> dict:
    """What the browser last said through Streamlit: {"have": frame token, "msg": message, "pull": n,
    "focus": [block, host], "el": the element's id}."""
    try:
        state = st.session_state[key]
    except KeyError:
        return {}
    sync = state.get("sync") if hasattr(state, "get") else None
    return sync if isinstance(sync, dict) else {}


@dataclass(eq=False)
class Element:
    """One browser element's exchange with this server, whichever way its asks come (a Streamlit
    rerun, or its lane: app/panels/lane.py): the frames sent and not yet acknowledged, the panels by
    message, and what composes its lane's messages (`compose_lane`, None: the lane is closed, asks
    go through Streamlit). A lane frame is composed under the same lock as a rerun's, from the same
    records."""
    sent: list[int] = field(default_factory=list)
    ledger: PanelLedger = field(default_factory=lambda: PanelLedger())
    compose_lane: Callable[[dict], bytes | None] | None = None
    gen: int = 0  # bumped whenever a rerun hands the lane a new `compose_lane`: frames of an older one are dropped
    interval_ms: int = 100  # the browser asks at most this often (the session's refresh setting)
    lane_sync: dict = field(default_factory=dict)  # the last ask that came by the lane
    lock: threading.RLock = field(default_factory=threading.RLock)

    def newest(self, sync: dict) -> dict:
        """The ask to answer: Streamlit's (`sync`), or the lane's when it is the same element's
        and later (Streamlit keeps the last ask it carried, which a heartbeat rerun would
        otherwise answer with a frame the browser no longer holds)."""
        lane = self.lane_sync
        later = lane.get("el") == sync.get("el") and lane.get("pull", 0) > sync.get("pull", 0)
        return lane if later else sync

    @property
    def lane_open(self) -> bool:
        """Whether the lane redraws now (what the browser is told), or asks go through Streamlit."""
        return self.compose_lane is not None

    def serve(self, sync: dict) -> bytes | None:
        """The lane's answer to an ask: the next message, or None (go through Streamlit)."""
        with self.lock:
            self.lane_sync = sync
            return self.compose_lane(sync) if self.compose_lane is not None else None

    def message(self, view: View, colors: dict[str, int], sync: dict, panels: dict | None, extra: dict,
                prof: Profile) -> bytes:
        """The next message to this element: a delta from the frame it said it holds (or from
        any sent since, not yet acknowledged), with the panels it may not hold."""
        with self.lock:
            frame = prof.timed("frame", lambda: frame_of(view, colors))
            also = unacknowledged(self.sent, sync.get("have"), frame.token)
            extra = {**extra, "pull": sync.get("pull", 0), "gen": self.gen, "interval": self.interval_ms}
            if (want := sync.get("focus")) and isinstance(want, list) and len(want) == 2:
                extra["focus"] = focus(view, int(want[0]), bool(want[1]), colors)
            if not sync.get("style"):  # a grid mounted afresh (a full rerun) has none yet, whatever the old one said
                extra["style"] = STYLE
            bases = [FRAMES.get(t) for t in also]
            known = None not in bases and len(bases) <= MAX_BASES  # else the canvas's frame is unknown: send it whole
            base = FRAMES.get(sync.get("have")) if known else None
            if panels is not None:
                extra["msg"], extra["panels"] = prof.timed("panels", lambda: self.ledger.out(
                    panels, sync.get("msg"), base is not None))
            return message(frame, base, extra, bases if known else [], prof)


def element(key: str) -> Element:
    """The session's exchange with the element `key`."""
    return st.session_state.setdefault(f"{key}_element", Element())


def show(view: View, colors: dict[str, int], *, key: str = "pool_grid", panels: dict | None = None,
         extra: dict | None = None, on: dict | None = None, prof: Profile | None = None) -> None:
    """Mount (or update) the live views' element: the grid, with a delta from the frame the
    browser holds, and `panels` (the other live views' data: assets/live.js draws them with the
    grid, in one step, so the page never shows two redraws at once). `extra` goes to the canvas
    as is: `connected` (False: say the stream stopped), `highlight` (blocks to ring), `lane`
    (where the element's lane is, and whether it redraws). `on`: the callbacks of the element's
    triggers and states by name (`block`: a block clicked, its id in st.session_state[key]["block"];
    `travel`, `tables`, `pin`, `why`)."""
    el = element(key)
    data = el.message(view, colors, el.newest(_sync(key)), panels, extra or {}, prof or Profile())
    callbacks = {f"on_{name}_change": f for name, f in (on or {}).items()}
    _component()(data=data, key=key, **{"on_block_change": _nothing, "on_sync_change": _nothing, **callbacks})


@dataclass
class PanelLedger:
    """Which live views went to one browser element with which message, so that a message
    carries only those the browser may not hold. Kept by message, not by frame: the same frame
    goes out again with other panels (a paused or travelled view), and a message that a newer
    rerun cut off never arrives (a panel recorded under its frame was then never sent again)."""
    record: dict[int, dict[str, int]] = field(default_factory=dict)  # message -> each panel's digest
    sent: list[int] = field(default_factory=list)  # messages after the last one acknowledged
    last: int = 0

    def out(self, panels: dict, have: int | None, known: bool) -> tuple[int, dict]:
        """(the next message's number, the panels it carries) when the browser last said it holds
        message `have` (`known`: with a frame this server still knows)."""
        self.last += 1
        later = unacknowledged(self.sent, have, self.last)
        held = [have, *later] if known and have in self.record else None
        return self.last, unsent(panels, self.record, held, self.last, self.sent)


def unsent(panels: dict, record: dict[int, dict[str, int]], held: list | None, token: int, sent: list[int]) -> dict:
    """The panels whose content the browser may not hold: it holds the message `held[0]` or one
    of the others of `held` (sent, not yet acknowledged; None: not known), each with the panels
    `record` says were sent with it. The panels sent with message `token` are recorded."""
    digests = {name: hash(json.dumps(value, separators=(",", ":"), sort_keys=True)) for name, value in panels.items()}
    out = {name: value for name, value in panels.items()
           if held is None or any(record.get(t, {}).get(name) != digests[name] for t in held)}
    record[token] = {**record.get(token, {}), **digests}
    for t in [t for t in record if t not in sent and t != token and (held is None or t not in held)]:
        del record[t]
    return out


def unacknowledged(sent: list[int], have, token: int) -> list[int]:
    """The frames sent to a canvas (`sent`, oldest first) after the one it last said it holds
    (`have`), which it may hold by now instead; `token` is recorded as sent."""
    if have in sent:
        del sent[:sent.index(have) + 1]
    out = [t for t in sent if t != token]
    if not sent or sent[-1] != token:
        sent.append(token)
    del sent[:-4 * MAX_BASES]
    return out


def _nothing() -> None:
    pass

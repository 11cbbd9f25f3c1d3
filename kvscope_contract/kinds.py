"""Every event kind in one registry: its words, its colour, and how the views treat it.

The grid's outlines, the timeline's and the scrubber's markers, the event log's colours and
default filter, and `engine.model.generate`'s tally all read this table; which blocks an event
touches is `touched_blocks`, what it did in words `words` (a new kind needs its row and its words
here, and its message in protocol.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvscope_contract import protocol as p


@dataclass(frozen=True)
class Kind:
    name: str             # the wire tag
    label: str            # what happened, in a few words
    color: str            # outline in the grid, marker on the timeline, colour in the log
    touch: int = 0        # drawn as a block outline in the grid; when a block saw several kinds
                          # in one step, the highest wins (0: not drawn)
    marker: bool = False  # a tick on the timeline and on the scrubber
    block: bool = False   # changes a block's ref count or hash
    noisy: bool = False   # one per token or per step: hidden from the event log by default


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("request_added", "request added", "#334155"),
    Kind("fork", "shared by a fork", "#a16207", touch=5, block=True),
    Kind("alloc", "allocated", "#16a34a", touch=3, block=True),
    Kind("prefix_hit", "prefix hit", "#2563eb", touch=4, block=True),
    Kind("cached", "registered in the prefix cache", "#64748b", block=True),
    Kind("evict", "evicted", "#dc2626", touch=6, block=True),
    Kind("cow", "copy-on-write", "#db2777", touch=9, block=True),
    Kind("free", "freed", "#64748b", touch=1, block=True),
    Kind("window_free", "left the sliding window", "#0d9488", touch=2, block=True),
    Kind("preempt", "preempted", "#b91c1c", marker=True, block=True),
    Kind("swap_out", "swapped out", "#7c3aed", touch=7, marker=True, block=True),
    Kind("swap_in", "swapped in", "#0891b2", touch=8, marker=True, block=True),
    Kind("append", "tokens appended", "#475569", noisy=True),
    Kind("status", "status changed", "#475569", noisy=True),
    Kind("finish", "finished", "#334155"),
    Kind("step", "step done", "#475569", noisy=True),
    Kind("reset", "engine reset", "#475569", marker=True),
    Kind("offload_store", "stored to the host tier", "#9333ea", block=True),
    Kind("offload_load", "loaded from the host tier", "#0e7490", touch=10, block=True),
    Kind("offload_evict", "evicted from the host tier", "#be123c", block=True),
)}
assert tuple(KINDS) == p.EVENT_KINDS, "every event kind of the protocol is registered, in order"

TOUCH_KINDS: tuple[str, ...] = tuple(sorted((k.name for k in KINDS.values() if k.touch),
                                            key=lambda n: KINDS[n].touch))
MARKER_KINDS: frozenset[str] = frozenset(k.name for k in KINDS.values() if k.marker)
BLOCK_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.block)
DEFAULT_LOG_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if not k.noisy)


def kind_of(ev: p.Event) -> str:
    return ev.__struct_config__.tag


def touched_blocks(ev: p.Event) -> tuple[list[int], list[int]]:
    """(device blocks, host blocks) that `ev` changes or names."""
    match ev:
        case p.Alloc() | p.PrefixHit() | p.Evict() | p.Free() | p.Cached() | p.WindowFree():
            return [ev.block_id], []
        case p.Fork():
            return [b for t in ev.block_tables or [ev.block_ids] for b in t if b != p.NULL_BLOCK], []
        case p.Cow():
            return [ev.src_block_id, ev.dst_block_id], []
        case p.OffloadStore() | p.OffloadLoad():
            return [ev.block_id], []
        case p.SwapOut():
            pairs = ev.mapping + ev.shared
            return [d for d, _ in pairs], [h for _, h in pairs]
        case p.SwapIn():
            pairs = ev.mapping + ev.shared
            return [d for _, d in pairs], [h for h, _ in pairs]
    return [], []


def words(ev: p.Event, groups: list[p.KVGroup] | None = None) -> str:
    """What `ev` did, in one line of words: the event log's line, the time-travel bar's caption.
    With a hybrid pool's `groups`, a table event names its KV-cache group."""
    said = _words(ev)
    if groups and len(groups) > 1 and (g := getattr(ev, "kv_group", None)) is not None:
        said += f" · {group_name(g, groups)}"
    return said


def group_name(g: int, groups: list[p.KVGroup]) -> str:
    """'group 5 (full)' or 'group 0 (window 512)'."""
    w = groups[g].window if g < len(groups) else None
    return f"group {g} ({'full' if w is None else f'window {w}'})"


def _words(ev: p.Event) -> str:
    match ev:
        case p.RequestAdded():
            return f"request {ev.request_id} added: {ev.prompt_tokens} prompt tokens, n={ev.n}, max {ev.max_tokens} new"
        case p.Fork():
            return f"forked from {ev.parent_seq_id}, sharing {len(ev.block_ids)} blocks"
        case p.Alloc():
            return f"logical {ev.logical_index} → new block {ev.block_id}"
        case p.PrefixHit():
            return f"logical {ev.logical_index} → cached block {ev.block_id} (hash {ev.hash[:8]})"
        case p.Cached():
            return f"block {ev.block_id} registered in the prefix cache (hash {ev.hash[:8]})"
        case p.Evict():
            return f"block {ev.block_id} evicted from the prefix cache"
        case p.Cow():
            return f"logical {ev.logical_index}: shared block {ev.src_block_id} copied to {ev.dst_block_id}"
        case p.Free():
            return f"block {ev.block_id} released (ref count now {ev.ref_count})"
        case p.WindowFree():
            return (f"logical {ev.logical_index}: block {ev.block_id} left the sliding window, released "
                    f"(ref count now {ev.ref_count})")
        case p.Preempt():
            return f"preempted ({ev.mode})"
        case p.SwapOut():
            return (f"{len(ev.mapping)} blocks swapped out to host " + ", ".join(f"{d}→H{h}" for d, h in ev.mapping[:6])
                    + (" …" if len(ev.mapping) > 6 else "") + _group(ev))
        case p.SwapIn():
            return (f"{len(ev.mapping)} blocks swapped in " + ", ".join(f"H{h}→{d}" for h, d in ev.mapping[:6])
                    + (" …" if len(ev.mapping) > 6 else "") + _group(ev))
        case p.Append():
            return f"{ev.num_tokens} tokens in cache" + (f", sampled {ev.text!r}" if ev.token_ids
                                                         else " (prefill chunk)")
        case p.StatusChange():
            return f"now {ev.status}"
        case p.Finish():
            return f"finished ({ev.reason})"
        case p.StepDone():
            return (f"step done in {ev.duration_ms:.1f} ms: {ev.prefill_tokens:,} prefill + {ev.decode_tokens:,} "
                    f"decode tokens; {ev.num_running:,} running, {ev.num_waiting:,} waiting, "
                    f"{ev.num_swapped:,} swapped; {ev.free_blocks:,} free, {ev.cached_blocks:,} cached")
        case p.OffloadStore():
            return f"block {ev.block_id} stored to the host tier as T{ev.offload_block_id} (hash {ev.hash[:8]})"
        case p.OffloadLoad():
            return (f"logical {ev.logical_index} → block {ev.block_id}, loaded from the host tier's "
                    f"T{ev.offload_block_id} (hash {ev.hash[:8]})")
        case p.OffloadEvict():
            return f"T{ev.offload_block_id} evicted from the host tier (hash {ev.hash[:8]})"
        case p.Reset():
            c = ev.config
            return (f"engine reset: {c.num_device_blocks} blocks of {c.block_size}, {c.num_host_blocks} host, "
                    + (f"{c.num_offload_blocks} in the host tier, " if c.num_offload_blocks else "") +
                    f"prefix cache {'on' if c.enable_prefix_caching else 'off'}, {c.preemption_mode}")
    return ""


def _group(ev: p.SwapOut | p.SwapIn) -> str:
    """A fork group swapped together: who went with it, and the blocks shared without a copy."""
    out = f" with {', '.join(ev.group[1:])}" if len(ev.group) > 1 else ""
    if ev.shared:
        where = ("already on the device (held, or found in the prefix cache)" if isinstance(ev, p.SwapIn)
                 else "shared with a copy already there")
        pairs = ", ".join(f"{a}→{b}" for a, b in ev.shared[:6])
        out += f"; {len(ev.shared)} {where}, not copied ({pairs})"
    return out

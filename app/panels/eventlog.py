"""The event log: newest first, filtered by kind, sequence and block; one line per event in
words, so an engineer can read the allocator's decisions one by one."""
from __future__ import annotations

import pandas as pd

from kvscope_contract import protocol as p
from kvscope_contract.kinds import KINDS, kind_of, touched_blocks


def describe(ev: p.AnyEvent) -> tuple[str, list[int], str]:
    """(sequence, device blocks involved, what happened in words)."""
    return getattr(ev, "seq_id", ""), touched_blocks(ev)[0], _words(ev)


def _words(ev: p.AnyEvent) -> str:
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
        case p.Preempt():
            return f"preempted ({ev.mode})"
        case p.SwapOut():
            return (f"{len(ev.mapping)} blocks swapped out to host " + ", ".join(f"{d}→H{h}" for d, h in ev.mapping[:6])
                    + (" …" if len(ev.mapping) > 6 else "") + _group(ev))
        case p.SwapIn():
            return (f"{len(ev.mapping)} blocks swapped in " + ", ".join(f"H{h}→{d}" for h, d in ev.mapping[:6])
                    + (" …" if len(ev.mapping) > 6 else "") + _group(ev))
        case p.Append():
            return f"{ev.num_tokens} tokens in cache" + (f", sampled {ev.text!r}" if ev.token_ids else " (prefill chunk)")
        case p.StatusChange():
            return f"now {ev.status}"
        case p.Finish():
            return f"finished ({ev.reason})"
        case p.StepDone():
            return (f"step done in {ev.duration_ms:.1f} ms: {ev.prefill_tokens:,} prefill + {ev.decode_tokens:,} "
                    f"decode tokens; {ev.num_running:,} running, {ev.num_waiting:,} waiting, "
                    f"{ev.num_swapped:,} swapped; {ev.free_blocks:,} free, {ev.cached_blocks:,} cached")
        case p.Reset():
            c = ev.config
            return (f"engine reset: {c.num_device_blocks} blocks of {c.block_size}, {c.num_host_blocks} host, "
                    f"prefix cache {'on' if c.enable_prefix_caching else 'off'}, {c.preemption_mode}")
    return ""


def matches(ev: p.AnyEvent, kinds: set[str], seq: str, block: int | None) -> bool:
    if kind_of(ev) not in kinds:
        return False
    sid = getattr(ev, "seq_id", "")
    if seq and not (sid == seq or sid.startswith(seq + ".") or getattr(ev, "parent_seq_id", None) == seq):
        return False
    return block is None or block in touched_blocks(ev)[0]


def frame(events: list[p.AnyEvent], kinds: set[str], seq: str = "", block: int | None = None,
          limit: int = 300) -> pd.DataFrame:
    """The newest `limit` events that pass the filters, newest first."""
    rows = []
    for ev in reversed(events):
        if matches(ev, kinds, seq, block):
            sid, blocks, what = describe(ev)
            rows.append((ev.seq, ev.step, ev.t, kind_of(ev), sid,
                         " ".join(map(str, blocks[:8])) + (" …" if len(blocks) > 8 else ""), what))
            if len(rows) >= limit:
                break
    return pd.DataFrame(rows, columns=["event", "step", "t (s)", "kind", "sequence", "blocks", "what happened"])


def styled(df: pd.DataFrame):
    """The kinds in the colours the grid outlines them with."""
    return df.style.map(lambda k: f"color: {KINDS[k].color}; font-weight: 600", subset=["kind"])


def _group(ev: p.SwapOut | p.SwapIn) -> str:
    """A fork group swapped together: who went with it, and the blocks shared without a copy."""
    out = f" with {', '.join(ev.group[1:])}" if len(ev.group) > 1 else ""
    if ev.shared:
        out += f"; {len(ev.shared)} shared with a copy already there (" + ", ".join(f"{a}→{b}" for a, b in ev.shared[:6]) + ")"
    return out

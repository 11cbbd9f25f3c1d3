"""The event log: newest first, filtered by kind, sequence and block; one line per event in
words, so an engineer can read the allocator's decisions one by one."""
from __future__ import annotations

import pandas as pd

from kvscope_contract import protocol as p
from kvscope_contract.kinds import KINDS, kind_of, touched_blocks, words


def describe(ev: p.AnyEvent) -> tuple[str, list[int], str]:
    """(sequence, device blocks involved, what happened in words)."""
    return getattr(ev, "seq_id", ""), touched_blocks(ev)[0], words(ev)


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

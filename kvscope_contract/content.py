"""Content identity for the prefix cache: a full block is named by the chain of token ids from
the start of its sequence, not by the hash its server gave it.

A server's block hash is only comparable within that server (vLLM's depends on its hash
algorithm and seed, a request's `cache_salt` and its LoRA; KVScope's engine hashes with
Python's tuple hash). The content id is the same everywhere: `content_id(parent's content id,
this block's token ids)`, a 64-bit BLAKE2b as 16 hex digits, with ROOT (the empty string) as
the parent of a sequence's first block. The fleet's index (app/fleet/content.py) and the
miss explainer (kvscope_contract/misses.py) both name content this way.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState

ROOT = ""  # the parent content id of a sequence's first block


def content_id(parent: str, tokens: Sequence[int]) -> str:
    h = hashlib.blake2b(parent.encode(), digest_size=8)
    h.update(np.asarray(tokens, "<u4").tobytes())
    return h.hexdigest()


def chain_ids(tokens: Sequence[int], block_size: int) -> list[str]:
    """The content ids of the full blocks of `tokens`, first block first."""
    out, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        parent = content_id(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def cached_holder(ev: p.Cached, state: PoolState) -> tuple[str | None, int | None]:
    """The sequence whose tokens fill the block a `cached` event registers, and the block's
    logical index in its group's table; `state` is the pool at the event (before or after: `cached`
    changes no table). The event's `seq_id` when it names one (KVScope's engine), else the
    block's one holder, else any sequence holding it (the vLLM plugin says no `seq_id`)."""
    b, seq_id, g = ev.block_id, ev.seq_id, ev.kv_group
    if seq_id is None and 0 <= b < len(state.ref_counts) and state.ref_counts[b] == 1:
        seq_id = state.names.get(int(state.holder[b]))
    candidates = [state.seqs[seq_id]] if seq_id in state.seqs else list(state.seqs.values())
    for s in candidates:
        table = s.block_tables[g] if g < len(s.block_tables) else ()  # the table of the block's KV-cache group
        for i in range(len(table) - 1, -1, -1):  # blocks are registered near the end
            if table[i] == b:
                return s.seq_id, i
    return None, None

"""A hybrid pool's KV-cache groups as the views say them: a name per group, the rows of a
sequence's block tables (groups whose tables look alike drawn as one row), and the pool's blocks
by group, with what a window saves against full attention on every layer.

A full-attention model has one group: every function here then gives what the views showed
before there were groups (one row, no breakdown).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.state import CACHED, NULL, SHARED, USED, PoolState, SeqState


def kind_name(group: p.KVGroup) -> str:
    """'sliding 512' or 'full'."""
    return "full" if group.window is None else f"sliding {group.window}"


def group_label(g: int, groups: list[p.KVGroup]) -> str:
    """'group 0 · sliding 512', 'group 5 · full'."""
    return f"group {g} · {kind_name(groups[g])}"


def span(gs: list[int]) -> str:
    """'0', '0–4' (consecutive) or '0, 2, 3'."""
    if len(gs) > 2 and gs == list(range(gs[0], gs[-1] + 1)):
        return f"{gs[0]}–{gs[-1]}"
    return ", ".join(map(str, gs))


def held_blocks(s: SeqState) -> int:
    """Device blocks in a sequence's tables, every group's (NULL entries hold none)."""
    if len(s.block_tables) == 1:
        return len(s.block_tables[0])
    return sum(len(t) - t.count(NULL) for t in s.block_tables)


def host_blocks(s: SeqState) -> int:
    if len(s.host_tables) == 1:
        return len(s.host_tables[0])
    return sum(len(t) - t.count(NULL) for t in s.host_tables)


# ------------------------------------------------------------------------- table rows
@dataclass(frozen=True)
class Row:
    """One row of a sequence's card: the table of `groups[0]`, standing for every group in
    `groups` (their tables alike: the same entries empty, shared, hit or copied)."""
    groups: tuple[int, ...]
    label: str  # '' for a one-group pool (no label: the card as it always was)


def _shape(table: list[int], g: int, origins: dict[tuple[int, int], str], shared: np.ndarray) -> tuple:
    """What a row draws of a table besides its block ids: empty entries, shared entries,
    where entries came from."""
    ids = np.asarray(table, np.int64)
    null = ids == NULL
    many = np.zeros(len(ids), bool)
    many[~null] = shared[ids[~null]] if len(shared) else False
    marks = tuple(sorted((i, o) for (gg, i), o in origins.items() if gg == g))
    return null.tobytes(), many.tobytes(), marks


def table_rows(state: PoolState, s: SeqState, origins: dict[tuple[int, int], str], every: bool = False,
               host: bool = False) -> list[Row]:
    """The rows of a sequence's card, in group order. With `every`, one per group; else groups of
    one kind whose tables look alike share a row ("×5"). A one-group pool: one unlabelled row."""
    groups = state.config.groups
    if len(groups) == 1:
        return [Row((0,), "")]
    tables = s.host_tables if host else s.block_tables
    if every:
        return [Row((g,), group_label(g, groups)) for g in range(len(groups))]
    shared = np.zeros(0, bool) if host else state.ref_counts > 1
    rows: list[list[int]] = []
    keys: list[tuple] = []
    for g, group in enumerate(groups):
        key = (group.kind, group.window, len(tables[g]), _shape(tables[g], g, origins, shared))
        if key in keys:
            rows[keys.index(key)].append(g)
        else:
            keys.append(key)
            rows.append([g])
    out = []
    for gs in rows:
        name = kind_name(groups[gs[0]])
        out.append(Row(tuple(gs), f"group {gs[0]} · {name}" if len(gs) == 1
                       else f"groups {span(gs)} · {name} ×{len(gs)}"))
    return out


# ------------------------------------------------------------------------- usage by group
@dataclass(frozen=True)
class GroupUsage:
    groups: tuple[int, ...]  # the groups of one kind (and window) summed here
    label: str               # 'sliding 512 ×5' or 'full'
    window: int | None
    used: int                # device blocks some sequence holds in these groups
    cached: int              # blocks these groups' prefix caches keep, no holder
    tokens: int              # tokens in the used blocks (a shared block once)
    slots: int               # the used blocks' slots (used x block size)
    reserved: int            # slots a contiguous reservation per sequence would hold in these groups
    reserved_tokens: int     # the tokens those slots would hold now

    @property
    def slot_util(self) -> float:
        return self.tokens / self.slots if self.slots else 1.0


def _reservation(s: SeqState, window: int | None) -> tuple[int, int]:
    """Slots a contiguous cache holds for a sequence in one group, and the tokens in them now:
    prompt + max tokens, or, for a sliding window, never more than the window (a ring of W
    slots)."""
    need = s.prompt_tokens + s.max_tokens
    return (need, s.num_tokens) if window is None else (min(need, window), min(s.num_tokens, window))


def by_kind(state: PoolState, states: np.ndarray | None = None) -> list[GroupUsage]:
    """The pool's blocks by kind of group (groups of one kind summed: 'sliding 512 ×5'), in the
    order kinds first appear. Empty for a one-group pool."""
    groups, bs = state.config.groups, state.config.block_size
    if len(groups) == 1:
        return []
    states = state.block_states() if states is None else states
    used, cached = (states == USED) | (states == SHARED), states == CACHED
    n = len(groups)
    used_by = np.bincount(state.kv_group[used], minlength=n)
    cached_by = np.bincount(state.kv_group[cached], minlength=n)
    tokens_by = np.bincount(state.kv_group[used], weights=state.tokens[used], minlength=n)
    holding = [s for s in state.seqs.values() if s.holds_blocks()]
    kinds: dict[tuple[str, int | None], list[int]] = {}
    for g, group in enumerate(groups):
        kinds.setdefault((group.kind, group.window), []).append(g)
    out = []
    for (_, window), gs in kinds.items():
        name = kind_name(groups[gs[0]]) + (f" ×{len(gs)}" if len(gs) > 1 else "")
        used_n = int(used_by[gs].sum())
        slots, held = (len(gs) * sum(x) for x in zip((0, 0), *(_reservation(s, window) for s in holding)))
        out.append(GroupUsage(tuple(gs), name, window, used_n, int(cached_by[gs].sum()), int(tokens_by[gs].sum()),
                              used_n * bs, slots, held))
    return out


def full_attention_everywhere(state: PoolState, kinds: list[GroupUsage]) -> int:
    """Blocks the pool would hold if every group attended to every token: each group as many as
    a full-attention group holds now (its tables name every block of every sequence, shared
    ones once), or, in a pool without one, every sequence's tokens in blocks."""
    n = len(state.config.groups)
    full = next((k for k in kinds if k.window is None), None)
    if full is not None:
        return n * full.used // len(full.groups)
    bs = state.config.block_size
    return n * sum(-(-s.num_tokens // bs) for s in state.seqs.values() if s.holds_blocks())

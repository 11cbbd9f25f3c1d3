"""The protocol's invariants 2-4 checked on a reducer state, and its derived columns against a
fresh derivation (docs/protocol.md): what the tests assert after every event they replay."""
from __future__ import annotations

import numpy as np

from kvscope_contract.state import NULL, InvariantError, PoolState, group_tables, table_entries


def check_invariants(state: PoolState) -> None:
    """Invariants 2-4 of the protocol, and the derived columns against a fresh derivation;
    raises InvariantError naming the first that fails."""
    seqs = list(state.seqs.values())
    n, num_groups = len(state.ref_counts), len(state.config.groups)
    tables, _ = group_tables(seqs, "block_tables", num_groups)
    flat, _, _ = table_entries(tables, [0] * len(tables), 1)
    holders = np.bincount(flat, minlength=n)
    if (state.ref_counts < 0).any():
        b = int(np.flatnonzero(state.ref_counts < 0)[0])
        raise InvariantError(f"block {b}: negative ref_count {state.ref_counts[b]}")
    if (bad := np.flatnonzero(holders != state.ref_counts)).size:
        b = int(bad[0])
        raise InvariantError(f"block {b}: ref_count {state.ref_counts[b]} but {holders[b]} sequences hold it")
    htables, _ = group_tables(seqs, "host_tables", num_groups)
    hflat, _, _ = table_entries(htables, [0] * len(htables), 1)
    host_holders = np.bincount(hflat, minlength=len(state.host_ref_counts))
    if (bad := np.flatnonzero(host_holders != state.host_ref_counts)).size:
        h = int(bad[0])
        raise InvariantError(f"host block {h}: ref_count {state.host_ref_counts[h]} but "
                             f"{host_holders[h]} sequences hold it")
    for s in seqs:
        if len(s.block_tables) != num_groups or len(s.host_tables) != num_groups:
            raise InvariantError(f"{s.seq_id} has {len(s.block_tables)} tables for {num_groups} KV-cache groups")
        for table in (*s.block_tables, *s.host_tables):
            real = [b for b in table if b != NULL]
            if len(set(real)) != len(real):
                raise InvariantError(f"{s.seq_id} names a block twice in its tables")
        for g, table in enumerate(s.block_tables):
            if (wrong := [b for b in table if b != NULL and state.kv_group[b] != g]):
                raise InvariantError(f"{s.seq_id}'s table of group {g} holds block {wrong[0]} of group "
                                     f"{state.kv_group[wrong[0]]}")
    fresh = PoolState.build(state.config, state.last_event, state.ref_counts,
                            (state.has_hash, state.hash64, state.odd_hashes), [s.clone() for s in seqs],
                            state.kv_group)
    for name in ("tokens", "host_tokens"):
        if (bad := np.flatnonzero(getattr(fresh, name) != getattr(state, name))).size:
            raise InvariantError(f"{name} of block {int(bad[0])} is {getattr(state, name)[bad[0]]}, "
                                 f"derived afresh {getattr(fresh, name)[bad[0]]}")
    for table, column in (("block_tables", state.holder), ("host_tables", state.host_holder)):
        xor = np.zeros(len(column), np.int32)  # in this state's keys (a fresh build numbers them anew)
        for s in seqs:
            for t in getattr(s, table):
                xor[[b for b in t if b != NULL]] ^= s.key
        if (bad := np.flatnonzero(xor != column)).size:
            raise InvariantError(f"holder of {table.split('_')[0]} block {int(bad[0])} is "
                                 f"{column[bad[0]]}, its holders' keys XOR to {xor[bad[0]]}")

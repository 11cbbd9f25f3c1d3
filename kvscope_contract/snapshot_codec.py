"""The pool's state on the wire and back: block hashes as the protocol writes them (16 hex
digits, in events and snapshots alike), and the snapshot in its two forms, one object per block
or packed columns (feature `columnar`). `PoolState.from_snapshot`, `snapshot()` and
`columnar_snapshot()` (kvscope_contract/state.py) are these functions, whose `st` is a PoolState
(not imported: the reducer imports this module); no torch, no I/O.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from kvscope_contract import protocol as p

MASK64 = (1 << 64) - 1  # a block hash goes on the wire as its low 64 bits, 16 hex digits
NULL = p.NULL_BLOCK
I32, U16 = np.dtype("<i4"), np.dtype("<u2")


def hash_hex(h: int) -> str:
    return f"{h & MASK64:016x}"


def hash_value(h: str) -> tuple[int, bool]:
    """A block hash as a 64-bit number, and whether it is the protocol's 16 lowercase hex
    digits (then the number gives it back exactly; any other string gets a digest)."""
    if len(h) == 16:
        try:
            v = int(h, 16)
        except ValueError:
            v = -1
        if v >= 0 and f"{v:016x}" == h:
            return v, True
    return int.from_bytes(hashlib.blake2b(h.encode(), digest_size=8).digest(), "big"), False


_HEX = np.full(256, 255, np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)


def hash_columns(hashes) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """Per block hash (str or None) -> (has a hash, `hash_value`, {block: the unusual ones}),
    vectorised for the protocol's 16 hex digits."""
    hashes = list(hashes)
    has = np.fromiter((h is not None for h in hashes), bool, len(hashes))
    ids = np.flatnonzero(has)
    given = [hashes[i] for i in ids.tolist()]
    values, odd = np.zeros(len(hashes), np.uint64), {}
    try:
        raw = np.array(given, dtype="S16").reshape(len(given))
    except UnicodeEncodeError:
        raw = None
    if raw is not None and len(given):
        nibbles = _HEX[raw.view(np.uint8).reshape(len(given), 16)]
        values[ids] = ((nibbles[:, 0::2] << 4) | nibbles[:, 1::2]).copy().view(">u8").ravel()
        lens = np.fromiter(map(len, given), np.int64, len(given))
        unusual = np.flatnonzero((lens != 16) | (nibbles == 255).any(axis=1)).tolist()
    else:
        unusual = range(len(given))
    for j in unusual:
        b, h = int(ids[j]), given[j]
        values[b], canonical = hash_value(h)
        if not canonical:
            odd[b] = h
    return has, values, odd


class Decoded(NamedTuple):
    """A snapshot's pools and tables, as `PoolState.build` takes them."""
    ref_counts: np.ndarray
    hashes: tuple[np.ndarray, np.ndarray, dict[int, str]]  # `hash_columns`' three
    kv_groups: np.ndarray | None        # the group of each device block (None: one group)
    block_tables: list[list[list[int]]]  # per sequence of `snap.seqs`, its table of each group
    host_tables: list[list[list[int]]]


def decode(snap: p.Snapshot) -> Decoded:
    """The pools and tables of a snapshot in either form."""
    if snap.columns is not None:
        return _from_columns(snap)
    n = snap.config.num_device_blocks
    ref, hashes, groups = np.zeros(n, np.int32), [None] * n, np.zeros(n, np.uint8)
    for b in snap.device_blocks:
        ref[b.id], hashes[b.id], groups[b.id] = b.ref_count, b.hash, b.kv_group
    return Decoded(ref, hash_columns(hashes), groups, [_tables(s.block_tables, s.block_table) for s in snap.seqs],
                   [_tables(s.host_tables, s.host_table) for s in snap.seqs])


def encode(st) -> p.Snapshot:
    """The wire's snapshot, one object per block."""
    return p.Snapshot(
        seq=st.last_event, config=st.config,
        device_blocks=[p.DeviceBlock(i, r, h, n, g) for i, (r, h, n, g) in enumerate(zip(
            st.ref_counts.tolist(), _hash_list(st), st.tokens.tolist(), st.kv_group.tolist()))],
        host_blocks=[p.HostBlock(i, o, n, r) for i, (o, n, r) in enumerate(zip(
            st.host_first_holders(), st.host_tokens.tolist(), st.host_ref_counts.tolist()))],
        seqs=_seq_infos(st, with_tables=True), offload_blocks=st.offload_blocks())


def encode_columns(st) -> p.Snapshot:
    """The same snapshot with its pools and tables as packed arrays (feature `columnar`)."""
    return p.Snapshot(seq=st.last_event, config=st.config, device_blocks=[], host_blocks=[],
                      seqs=_seq_infos(st, with_tables=False), columns=_pack_columns(st),
                      offload_blocks=st.offload_blocks())


def _hash_list(st) -> list[str | None]:
    out: list[str | None] = [None] * len(st.has_hash)
    ids = np.flatnonzero(st.has_hash)
    for b, h in zip(ids.tolist(), st.hash_strings(ids)):
        out[b] = h
    return out


def _seq_infos(st, with_tables: bool) -> list[p.SeqInfo]:
    every = with_tables and len(st.config.groups) > 1
    return [p.SeqInfo(seq_id=s.seq_id, request_id=s.request_id, status=s.status,
                      block_table=list(s.block_table) if with_tables else [],
                      host_table=list(s.host_table) if with_tables else [],
                      num_tokens=s.num_tokens, prompt_tokens=s.prompt_tokens,
                      output_tokens=s.output_tokens, max_tokens=s.max_tokens, text=s.text,
                      block_tables=[list(t) for t in s.block_tables] if every else [],
                      host_tables=[list(t) for t in s.host_tables] if every else [])
            for s in st.seqs.values()]


def _tables(every: list[list[int]], first: list[int]) -> list[list[int]]:
    """A wire sequence's tables: every group's when given, else its one table."""
    return [list(t) for t in every] if every else [list(first)]


def _pack(tables: list[list[int]]) -> tuple[bytes, bytes]:
    lens = np.fromiter(map(len, tables), I32, len(tables))
    return np.fromiter((b for t in tables for b in t), I32, int(lens.sum())).tobytes(), lens.tobytes()


def _unpack(flat: bytes, lens: bytes, num_groups: int) -> list[list[list[int]]]:
    """Per sequence, its tables of every group (the columns hold them sequence by sequence)."""
    cuts = np.cumsum(np.frombuffer(lens, I32))[:-1]
    tables = [t.tolist() for t in np.split(np.frombuffer(flat, I32), cuts)] if lens else []
    return [tables[i:i + num_groups] for i in range(0, len(tables), num_groups)]


def _pack_columns(st) -> p.SnapshotColumns:
    seqs = list(st.seqs.values())
    host_seq = np.zeros(len(st.host_ref_counts), I32)
    for i, s in reversed(list(enumerate(seqs, 1))):  # the first holder wins, as in `host_blocks`
        for table in s.host_tables:
            if held := [h for h in table if h != NULL]:
                host_seq[held] = i
    hashed = np.flatnonzero(st.has_hash)
    tables, lengths = _pack([t for s in seqs for t in s.block_tables])
    host_tables, host_lengths = _pack([t for s in seqs for t in s.host_tables])
    return p.SnapshotColumns(
        ref_count=st.ref_counts.astype(I32).tobytes(), num_tokens=st.tokens.astype(U16).tobytes(),
        hash_block_ids=hashed.astype(I32).tobytes(), hashes=st.hash64[hashed].astype("<u8").tobytes(),
        odd_hashes=sorted(st.odd_hashes.items()),
        host_seq=host_seq.tobytes(), host_num_tokens=st.host_tokens.astype(U16).tobytes(),
        block_tables=tables, block_table_lengths=lengths, host_tables=host_tables,
        host_table_lengths=host_lengths,
        kv_group=st.kv_group.tobytes() if len(st.config.groups) > 1 else None)


def _from_columns(snap: p.Snapshot) -> Decoded:
    c, n, num_groups = snap.columns, snap.config.num_device_blocks, len(snap.config.groups)
    ref = np.frombuffer(c.ref_count, I32)
    if len(ref) != n:
        raise ValueError(f"columnar snapshot: {len(ref)} ref counts for {n} device blocks")
    ids = np.frombuffer(c.hash_block_ids, I32)
    has, values = np.zeros(n, bool), np.zeros(n, np.uint64)
    has[ids], values[ids] = True, np.frombuffer(c.hashes, "<u8")
    odd = dict(c.odd_hashes)
    for b, h in odd.items():
        values[b] = hash_value(h)[0]
    tables = _unpack(c.block_tables, c.block_table_lengths, num_groups)
    host_tables = _unpack(c.host_tables, c.host_table_lengths, num_groups)
    seqs = range(len(snap.seqs))
    return Decoded(ref, (has, values, odd), np.frombuffer(c.kv_group, np.uint8) if c.kv_group else None,
                   [tables[i] if tables else [[] for _ in range(num_groups)] for i in seqs],
                   [host_tables[i] if host_tables else [[] for _ in range(num_groups)] for i in seqs])

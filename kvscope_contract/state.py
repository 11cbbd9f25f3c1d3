"""The event reducer: the state of the block pools as a pure function of the event stream.

`PoolState.from_snapshot(s)` then `apply(event)` for each event gives exactly the state the
engine's next snapshot describes (protocol invariant 1). The server, the dashboard, replay,
time travel and the tests all use this one reducer. No torch, no I/O, no clock: `apply` only
mutates the state it is called on, and `clone()` gives checkpoints for scrubbing.

Per-block state lives in numpy arrays, so a pool of a million blocks clones in milliseconds
and every view reads it vectorised. Besides what the wire carries (ref count, hash, host
owner, KV-cache group) the reducer keeps two derived columns up to date, O(1) per block an
event touches: the tokens each block holds (the rule of docs/protocol.md) and `holder`, the
XOR of the keys of the sequences that hold a block, which is the one holder's key when
`ref_count == 1`. A sequence has a block table per KV-cache group (one for a full-attention
model), NULL_BLOCK where a sliding window has passed. Sequences are copied on write: a clone
shares them until either side changes one.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.snapshot_codec import decode, encode, encode_columns, hash_value

# A device block's state, as the views colour it (see docs/protocol.md, snapshot). RESERVED:
# a block the allocator never hands out (`PoolConfig.reserved_blocks`), counted in no state.
FREE, CACHED, USED, SHARED, RESERVED = 0, 1, 2, 3, 4
STATE_NAMES = ("free", "cached", "used", "shared", "reserved")  # by code
TOKENS = np.uint16  # tokens per block (block_size <= 256)
NULL = p.NULL_BLOCK


class InvariantError(ValueError):
    """An event that cannot follow the current state (names the event)."""


class GroupTables:
    """A sequence's tables, one per KV-cache group (`block_tables`, `host_tables`), read as one
    table where one is meant: a full-attention model's only one is group 0's."""
    block_tables: list[list[int]]
    host_tables: list[list[int]]

    @property
    def block_table(self) -> list[int]:
        """Group 0's device table (a full-attention model's only one)."""
        return self.block_tables[0]

    @property
    def host_table(self) -> list[int]:
        """Group 0's host table, while swapped out."""
        return self.host_tables[0]


@dataclass
class SeqState(GroupTables):
    seq_id: str
    request_id: str
    status: p.Status = "waiting"
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])  # one per KV-cache group
    host_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = p.DEFAULT_MAX_TOKENS
    text: str = ""
    key: int = 0  # this state's small integer name for the sequence (1, 2, ... in creation order)
    added: float | None = None  # engine time of its request_added or fork (None: before a snapshot)

    def holds_blocks(self) -> bool:
        """Whether any of its device tables names a block."""
        return any(b != NULL for t in self.block_tables for b in t)

    def clone(self) -> SeqState:
        c = copy.copy(self)
        c.block_tables = [t[:] for t in self.block_tables]
        c.host_tables = [t[:] for t in self.host_tables]
        return c


class BlockCounts(NamedTuple):
    free: int       # no holder, never hashed (the `free_blocks` of a `step` event)
    cached: int     # no holder, hashed: evictable, still hit-able
    used: int       # held by at least one sequence
    shared: int     # held by two or more (counted in `used` too)
    host_used: int  # host blocks holding a swapped-out block


def used_blocks(config: p.PoolConfig, free: int, cached: int) -> int:
    """Device blocks some sequence holds, from a pool's free and cached counts (a `step`
    event's): the rest of the pool but its reserved blocks, as `PoolState.counts` counts them."""
    return config.num_device_blocks - len(config.reserved_blocks) - free - cached


def held_tokens(num_tokens: int, index: int, block_size: int) -> int:
    """Tokens in logical block `index` of a sequence whose cache holds `num_tokens`."""
    return min(block_size, max(0, num_tokens - index * block_size))


def table_entries(tables: list[list[int]], num_tokens: list[int], block_size: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every entry of many block tables at once, NULL entries left out: (block id, holder index
    from 1, tokens held), `held_tokens` vectorised."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    flat = np.fromiter((b for t in tables for b in t), np.int64, int(lens.sum()))
    holder = np.repeat(np.arange(1, len(tables) + 1), lens)
    index = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    held = np.clip(np.repeat(np.asarray(num_tokens, np.int64), lens) - index * block_size, 0, block_size)
    if (real := flat != NULL).all():
        return flat, holder, held
    return flat[real], holder[real], held[real]


def group_tables(seqs: list[SeqState], tables: str, num_groups: int) -> tuple[list[list[int]], list[int]]:
    """Every sequence's `tables` ("block_tables" or "host_tables") of every group, group by
    group, and the index in `seqs` of each one's sequence: `table_entries`' input for all groups."""
    out = [getattr(s, tables)[g] for g in range(num_groups) for s in seqs]
    return out, [i for _ in range(num_groups) for i in range(len(seqs))]


@dataclass
class PoolState:
    config: p.PoolConfig
    last_event: int = 0  # the number (`seq`) of the last event applied
    ref_counts: np.ndarray = None   # int32 per device block
    has_hash: np.ndarray = None     # bool per device block
    hash64: np.ndarray = None       # uint64 per device block: `hash_value` of its hash, 0 without
    odd_hashes: dict = field(default_factory=dict)  # block -> a hash not in the protocol's form, as given
    tokens: np.ndarray = None       # TOKENS per device block (derived, see `block_tokens`)
    holder: np.ndarray = None       # int32 per device block: XOR of its holders' keys
    host_ref_counts: np.ndarray = None  # int32 per host block: the swapped sequences holding it
    host_holder: np.ndarray = None  # int32 per host block: XOR of its holders' keys, 0 when free
    host_tokens: np.ndarray = None  # TOKENS per host block (the most among its holders)
    kv_group: np.ndarray = None     # uint8 per device block: the group whose table holds it, or
    #                                 whose prefix cache keeps it (0 when free; all 0 with one group)
    offload_has: np.ndarray = None  # bool per block of the host tier (protocol 3): holds content
    offload_hash64: np.ndarray = None  # uint64 per block of the host tier: `hash_value` of its hash
    offload_group: np.ndarray = None   # uint8 per block of the host tier: the group it caches for
    offload_odd: dict = field(default_factory=dict)  # host-tier block -> a hash not in the protocol's form
    seqs: dict[str, SeqState] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # key -> seq_id of every live sequence
    next_key: int = 1
    _mine: set = field(default_factory=set, repr=False, compare=False)  # seq_ids not shared with a clone

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty(cls, config: p.PoolConfig, last_event: int = 0) -> PoolState:
        n, m, o = config.num_device_blocks, config.num_host_blocks, config.num_offload_blocks
        return cls(config=config, last_event=last_event, ref_counts=np.zeros(n, np.int32),
                   has_hash=np.zeros(n, bool), hash64=np.zeros(n, "<u8"), tokens=np.zeros(n, TOKENS),
                   holder=np.zeros(n, np.int32), host_ref_counts=np.zeros(m, np.int32),
                   host_holder=np.zeros(m, np.int32), host_tokens=np.zeros(m, TOKENS),
                   kv_group=np.zeros(n, np.uint8), offload_has=np.zeros(o, bool),
                   offload_hash64=np.zeros(o, "<u8"), offload_group=np.zeros(o, np.uint8))

    @classmethod
    def from_snapshot(cls, snap: p.Snapshot) -> PoolState:
        """The state a snapshot (either form, kvscope_contract/snapshot_codec.py) describes."""
        d = decode(snap)
        seqs = [SeqState(s.seq_id, s.request_id, s.status, tables, host_tables, s.num_tokens, s.prompt_tokens,
                         s.output_tokens, s.max_tokens, s.text)
                for s, tables, host_tables in zip(snap.seqs, d.block_tables, d.host_tables)]
        return cls.build(snap.config, snap.seq, d.ref_counts, d.hashes, seqs, d.kv_groups,
                         [(b.id, b.hash, b.kv_group) for b in snap.offload_blocks])

    @classmethod
    def build(cls, config: p.PoolConfig, last_event: int, ref_counts, hashes, seqs: list[SeqState],
              kv_groups=None, offload: list[tuple[int, str, int]] = ()) -> PoolState:
        """A state from the wire's columns (ref counts; hashes: `hash_columns` of them; the
        group of each block, where it matters: None with one group), every live sequence in
        creation order and the host tier's (block, hash, group); host owners and the derived
        columns follow from the tables. (Which entries came from the host tier is history: a
        snapshot does not carry it.)"""
        st = cls.empty(config, last_event)
        for t, h, g in offload:
            st._offload_set(t, h, g)
        st.ref_counts[:] = ref_counts
        st.has_hash[:], st.hash64[:], odd = hashes
        st.odd_hashes = dict(odd)
        if kv_groups is not None:
            st.kv_group[:] = kv_groups
        for s in seqs:
            st._add_seq(s)
        bs, num_groups = config.block_size, len(config.groups)
        keys = np.fromiter((s.key for s in seqs), np.int32, len(seqs))
        tables, owner = group_tables(seqs, "block_tables", num_groups)
        nums = [seqs[i].num_tokens for i in owner]
        flat, who, held = table_entries(tables, nums, bs)
        who = np.asarray(owner, np.int64)[who - 1] if len(who) else who  # table index -> sequence index
        tokens = np.where(st.has_hash, bs, 0)
        np.maximum.at(tokens, flat, held)
        st.tokens[:] = tokens
        np.bitwise_xor.at(st.holder, flat, keys[who])
        if num_groups > 1:
            lens = [sum(t != NULL for t in table) for table in tables]
            st.kv_group[flat] = np.repeat(np.arange(len(tables)) // max(len(seqs), 1), lens)
        htables, howner = group_tables(seqs, "host_tables", num_groups)
        hflat, hwho, hheld = table_entries(htables, [seqs[i].num_tokens for i in howner], bs)
        hwho = np.asarray(howner, np.int64)[hwho - 1] if len(hwho) else hwho
        np.add.at(st.host_ref_counts, hflat, 1)
        np.maximum.at(st.host_tokens, hflat, hheld.astype(TOKENS))
        np.bitwise_xor.at(st.host_holder, hflat, keys[hwho])
        return st

    def clone(self) -> PoolState:
        """A deep copy in O(blocks) memcpy: sequences are shared until one side changes one."""
        c = copy.copy(self)
        for name in _ARRAYS:
            setattr(c, name, getattr(self, name).copy())
        c.seqs, c.names, c.odd_hashes = dict(self.seqs), dict(self.names), dict(self.odd_hashes)
        c.offload_odd = dict(self.offload_odd)
        self._mine, c._mine = set(), set()
        return c

    def nbytes(self) -> int:
        """About what a copy of this state holds on its own once the original has moved on: its
        arrays, and its sequences (their tables' entries at 8 bytes, and the objects)."""
        entries = sum(map(len, (t for s in self.seqs.values() for t in (*s.block_tables, *s.host_tables))))
        return sum(getattr(self, a).nbytes for a in _ARRAYS) + 8 * entries + 600 * len(self.seqs)

    # ------------------------------------------------------------------ derived views
    def hashed(self) -> np.ndarray:
        return self.has_hash

    def hash_of(self, b: int) -> str | None:
        if not self.has_hash[b]:
            return None
        return self.odd_hashes.get(b) or f"{int(self.hash64[b]):016x}"

    def hash_strings(self, ids: np.ndarray) -> list[str]:
        """The hashes of blocks `ids` (which all have one), vectorised."""
        digits = self.hash64[ids].astype(">u8").tobytes().hex()
        out = [digits[i:i + 16] for i in range(0, len(digits), 16)]
        for j, b in enumerate(ids.tolist()) if self.odd_hashes else ():
            out[j] = self.odd_hashes.get(b, out[j])
        return out

    @property
    def hash32(self) -> np.ndarray:
        """The first 32 bits of each block's hash (uint32; 0 without one): a view."""
        return self.hash64.view("<u4")[1::2]

    def block_states(self) -> np.ndarray:
        """FREE, CACHED, USED, SHARED or RESERVED per device block (uint8)."""
        ref = self.ref_counts
        out = np.where(self.has_hash, CACHED, FREE).astype(np.uint8)
        out[ref == 1] = USED
        out[ref >= 2] = SHARED
        out[self.config.reserved_blocks] = RESERVED
        return out

    def counts(self, states: np.ndarray | None = None) -> BlockCounts:
        """`states`: this state's `block_states()`, when the caller has them already."""
        states = self.block_states() if states is None else states
        # a pass per state: bincount would first copy a million states into 64-bit integers
        n = [int(np.count_nonzero(states == code)) for code in range(RESERVED + 1)]
        return BlockCounts(n[FREE], n[CACHED], n[USED] + n[SHARED], n[SHARED],
                           int(np.count_nonzero(self.host_ref_counts)))

    def block_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """Tokens held per device block and per host block (derived, see protocol.md): a
        shared block shows the most among its holders, a cached block with no holder is full."""
        return self.tokens.astype(np.int64), self.host_tokens.astype(np.int64)

    def tokens_in_used_blocks(self, states: np.ndarray | None = None) -> int:
        """Tokens stored in the device blocks some sequence holds, a shared block once: over
        `used * block_size` slots, the slot utilisation (1 - internal fragmentation). `states`:
        this state's `block_states()`, when the caller has them already."""
        states = self.block_states() if states is None else states
        return int(self.tokens[states >= USED].sum(dtype=np.int64))

    def offload_hash_of(self, t: int) -> str | None:
        """The hash host-tier block t holds, or None when it is free."""
        if not self.offload_has[t]:
            return None
        return self.offload_odd.get(t) or f"{int(self.offload_hash64[t]):016x}"

    def offload_blocks(self) -> list[p.OffloadBlock]:
        """The host tier's blocks that hold content, as the snapshot lists them."""
        return [p.OffloadBlock(t, self.offload_hash_of(t), int(self.offload_group[t]))
                for t in np.flatnonzero(self.offload_has).tolist()]

    def prefix_lookup(self, ev: p.AnyEvent) -> int:
        """Tokens the engine looks up in the prefix cache at the admission that `ev` begins (the
        first `prefix_hit` or `alloc` of a waiting sequence that holds no block: every token it
        holds so far, a re-admission after a recompute preemption included); 0 for any other
        event, and with prefix caching off. Call it before applying `ev`. Counted here, hits
        (`prefix_hit_tokens`) never outnumber the tokens looked up, at any event."""
        if not (isinstance(ev, (p.PrefixHit, p.Alloc, p.OffloadLoad)) and self.config.enable_prefix_caching):
            return 0
        s = self.seqs.get(ev.seq_id)
        if s is None or s.status != "waiting" or any(s.block_tables):
            return 0
        return s.prompt_tokens + s.output_tokens

    def prefix_hit_tokens(self, ev: p.AnyEvent) -> int:
        """Tokens of the admission's prefix hit that a `prefix_hit` adds (0 for any other event):
        the hit reaches the end of the furthest block any group found, so each group's hits
        count once, not once per group. Call it before applying `ev`."""
        if not isinstance(ev, p.PrefixHit):
            return 0
        s = self.seqs.get(ev.seq_id)
        reach = max(map(len, s.block_tables)) if s is not None else 0
        return max(0, ev.logical_index + 1 - reach) * self.config.block_size

    def snapshot(self) -> p.Snapshot:
        """The wire's snapshot, one object per block."""
        return encode(self)

    def columnar_snapshot(self) -> p.Snapshot:
        """The same snapshot with its pools and tables as packed arrays (feature `columnar`)."""
        return encode_columns(self)

    def host_first_holders(self) -> list[str | None]:
        """Per host block, the first sequence (in creation order) that holds it; None when free."""
        out: list[str | None] = [None] * len(self.host_ref_counts)
        for s in self.seqs.values():
            for table in s.host_tables:
                for h in table:
                    if h != NULL:
                        out[h] = out[h] or s.seq_id
        return out

    # ------------------------------------------------------------------ the reducer
    def apply(self, ev: p.AnyEvent) -> None:
        if ev.seq != self.last_event + 1:
            raise InvariantError(f"event {ev.seq} ({ev.__struct_config__.tag}) does not follow "
                                 f"event {self.last_event}: events must be numbered one by one")
        try:
            _HANDLERS[type(ev)](self, ev)
        except InvariantError as e:
            raise InvariantError(f"event {ev.seq} ({ev.__struct_config__.tag}): {e}") from None
        except (IndexError, KeyError) as e:
            raise InvariantError(f"event {ev.seq} ({ev.__struct_config__.tag}) names an unknown "
                                 f"block or sequence: {e!r}") from None
        self.last_event = ev.seq

    def _live(self, seq_id: str) -> SeqState:
        s = self.seqs.get(seq_id)
        if s is None:
            raise InvariantError(f"no live sequence {seq_id!r}")
        return s

    def _seq(self, seq_id: str) -> SeqState:
        """The live sequence, ready to change: copied first if a clone shares it."""
        s = self._live(seq_id)
        if seq_id not in self._mine:
            s = self.seqs[seq_id] = s.clone()
            self._mine.add(seq_id)
        return s

    def _add_seq(self, s: SeqState) -> None:
        if s.seq_id in self.seqs:
            raise InvariantError(f"sequence {s.seq_id!r} already exists")
        s.key, self.next_key = self.next_key, self.next_key + 1
        self.seqs[s.seq_id], self.names[s.key] = s, s.seq_id
        self._mine.add(s.seq_id)

    def _check_block(self, b: int) -> None:
        if not 0 <= b < len(self.ref_counts):
            raise InvariantError(f"device block {b} is outside the pool of {len(self.ref_counts)}")

    def _check_host(self, h: int) -> None:
        if not 0 <= h < len(self.host_ref_counts):
            raise InvariantError(f"host block {h} is outside the host pool of {len(self.host_ref_counts)}")

    def _take_free(self, b: int, s: SeqState, index: int, group: int) -> None:
        self._check_block(b)
        if b in self.config.reserved_blocks:
            raise InvariantError(f"block {b} is reserved: the allocator never hands it out")
        if self.ref_counts[b] or self.has_hash[b]:
            raise InvariantError(f"block {b} is not free (ref_count {self.ref_counts[b]}, "
                                 f"hash {self.hash_of(b)})")
        self.ref_counts[b] = 1
        self.holder[b] = s.key
        self.tokens[b] = held_tokens(s.num_tokens, index, self.config.block_size)
        self.kv_group[b] = group

    def _join(self, b: int, s: SeqState) -> None:
        """`s` becomes one more holder of block b (its tokens: the holders agree on them)."""
        self.ref_counts[b] += 1
        self.holder[b] ^= s.key

    def _leave(self, b: int, s: SeqState, index: int) -> None:
        """`s` stops holding block b (logical `index` of its table, where every holder has it)."""
        self.ref_counts[b] -= 1
        self.holder[b] ^= s.key
        if not (self.ref_counts[b] or self.has_hash[b]):
            self.kv_group[b] = 0  # free: of no group
        self._settle(b, held_tokens(s.num_tokens, index, self.config.block_size), index)

    def _settle(self, b: int, gone: int, index: int) -> None:
        """Block b's tokens after a holder that showed `gone` of them left or emptied it: full
        when hashed; else the most among the holders left. Several holders write a block only
        after copying it on write, so they agree with each other: only a partly filled block
        whose count came from the one that left needs a look at the others."""
        bs, ref = self.config.block_size, self.ref_counts[b]
        if self.has_hash[b]:
            self.tokens[b] = bs
        elif ref <= 1:
            self.tokens[b] = ref and held_tokens(self.seqs[self.names[self.holder[b]]].num_tokens, index, bs)
        elif gone == self.tokens[b] and gone < bs:
            g = self.kv_group[b]
            self.tokens[b] = max((held_tokens(t.num_tokens, index, bs) for t in self.seqs.values()
                                  if index < len(t.block_tables[g]) and t.block_tables[g][index] == b), default=0)

    def _table(self, s: SeqState, group: int) -> list[int]:
        if not 0 <= group < len(s.block_tables):
            raise InvariantError(f"KV-cache group {group} is not one of the pool's {len(s.block_tables)}")
        return s.block_tables[group]

    def _set_table(self, s: SeqState, group: int, index: int, b: int) -> None:
        """table[index] = b in `s`'s table of `group`; a sliding-window group's table may skip
        entries a window or a prefix hit passed over (they become NULL_BLOCK)."""
        table = self._table(s, group)
        if index > len(table) and self.config.groups[group].kind == "sliding_window":
            table += [NULL] * (index - len(table))
        if index == len(table):
            table.append(b)
        elif index < len(table):
            table[index] = b
        else:
            raise InvariantError(f"logical index {index} skips past the end of {s.seq_id}'s "
                                 f"table of {len(table)}")

    def _new_tables(self) -> list[list[int]]:
        return [[] for _ in self.config.groups]

    def _request_added(self, ev: p.RequestAdded) -> None:
        self._add_seq(SeqState(ev.seq_id, ev.request_id, block_tables=self._new_tables(),
                               host_tables=self._new_tables(), prompt_tokens=ev.prompt_tokens,
                               max_tokens=ev.max_tokens, added=ev.t))

    def _fork(self, ev: p.Fork) -> None:
        parent = self._live(ev.parent_seq_id)
        tables = ev.block_tables or [ev.block_ids]
        if tables != parent.block_tables or ev.block_ids != parent.block_table:
            raise InvariantError(f"block_ids {ev.block_ids} (block_tables {ev.block_tables}) are not "
                                 f"{parent.seq_id}'s tables {parent.block_tables}")
        child = SeqState(ev.seq_id, ev.request_id, parent.status, [list(t) for t in tables],
                         self._new_tables(), parent.num_tokens, parent.prompt_tokens,
                         parent.output_tokens, parent.max_tokens, parent.text, added=ev.t)
        self._add_seq(child)
        ids = np.fromiter((b for t in tables for b in t if b != NULL), np.int64)
        self.ref_counts[ids] += 1
        self.holder[ids] ^= child.key

    def _alloc(self, ev: p.Alloc) -> None:
        s = self._seq(ev.seq_id)
        if ev.logical_index > len(self._table(s, ev.kv_group)):
            self._set_table(s, ev.kv_group, ev.logical_index, NULL)  # raises unless a window skips there
        self._take_free(ev.block_id, s, ev.logical_index, ev.kv_group)
        self._set_table(s, ev.kv_group, ev.logical_index, ev.block_id)

    def _prefix_hit(self, ev: p.PrefixHit) -> None:
        s = self._seq(ev.seq_id)
        self._check_block(ev.block_id)
        if (have := self.hash_of(ev.block_id)) != ev.hash:
            raise InvariantError(f"block {ev.block_id} carries hash {have}, not {ev.hash}")
        if self.kv_group[ev.block_id] != ev.kv_group:
            raise InvariantError(f"block {ev.block_id} is cached for KV-cache group "
                                 f"{self.kv_group[ev.block_id]}, not {ev.kv_group}")
        self._set_table(s, ev.kv_group, ev.logical_index, ev.block_id)
        self._join(ev.block_id, s)

    def _cached(self, ev: p.Cached) -> None:
        b = ev.block_id
        self._check_block(b)
        if not self.ref_counts[b]:
            raise InvariantError(f"block {b} is cached while no sequence holds it")
        if self.kv_group[b] != ev.kv_group:
            raise InvariantError(f"block {b} is held in KV-cache group {self.kv_group[b]}, "
                                 f"cached for {ev.kv_group}")
        self.hash64[b], canonical = hash_value(ev.hash)
        self.has_hash[b], self.tokens[b] = True, self.config.block_size
        if not canonical:
            self.odd_hashes[b] = ev.hash
        elif self.odd_hashes:
            self.odd_hashes.pop(b, None)

    def _evict(self, ev: p.Evict) -> None:
        b = ev.block_id
        self._check_block(b)
        if self.ref_counts[b] or self.hash_of(b) != ev.hash:
            raise InvariantError(f"block {b} is not a cached block with hash {ev.hash} "
                                 f"(ref_count {self.ref_counts[b]}, hash {self.hash_of(b)})")
        self.hash64[b], self.has_hash[b], self.tokens[b], self.kv_group[b] = 0, False, 0, 0
        if self.odd_hashes:
            self.odd_hashes.pop(b, None)

    def _cow(self, ev: p.Cow) -> None:
        s = self._seq(ev.seq_id)
        i, src, table = ev.logical_index, ev.src_block_id, self._table(s, ev.kv_group)
        if i >= len(table) or table[i] != src:
            raise InvariantError(f"{s.seq_id} does not hold block {src} at index {i}")
        if self.ref_counts[src] < 2:
            raise InvariantError(f"copy-on-write of block {src}, which is not shared")
        self._take_free(ev.dst_block_id, s, i, ev.kv_group)
        table[i] = ev.dst_block_id
        self._leave(src, s, i)

    def _free(self, ev: p.Free) -> None:
        s = self._seq(ev.seq_id)
        b, table = ev.block_id, self._table(s, ev.kv_group)
        if table and table[-1] == b:
            index = len(table) - 1
            table.pop()
        elif b in table:
            index = table.index(b)
            del table[index]
        else:
            raise InvariantError(f"{s.seq_id} does not hold block {b}")
        while table and table[-1] == NULL:  # entries a window passed hold nothing: gone with the rest
            table.pop()
        self._leave(b, s, index)
        if self.ref_counts[b] != ev.ref_count:
            raise InvariantError(f"block {b} has ref_count {self.ref_counts[b]} after the free, "
                                 f"the event says {ev.ref_count}")

    def _window_free(self, ev: p.WindowFree) -> None:
        s = self._seq(ev.seq_id)
        i, b, table = ev.logical_index, ev.block_id, self._table(s, ev.kv_group)
        if self.config.groups[ev.kv_group].kind != "sliding_window":
            raise InvariantError(f"KV-cache group {ev.kv_group} has no sliding window")
        if i >= len(table) or table[i] != b:
            raise InvariantError(f"{s.seq_id} does not hold block {b} at index {i}")
        table[i] = NULL
        self._leave(b, s, i)
        if self.ref_counts[b] != ev.ref_count:
            raise InvariantError(f"block {b} has ref_count {self.ref_counts[b]} after the free, "
                                 f"the event says {ev.ref_count}")

    def _preempt(self, ev: p.Preempt) -> None:
        s = self._seq(ev.seq_id)
        if ev.mode == "swap":
            s.status = "swapped"
            return
        before, bs = s.num_tokens, self.config.block_size
        s.status, s.num_tokens = "waiting", 0
        for table in s.block_tables:  # its blocks no longer show its tokens
            for i, b in enumerate(table):
                if b != NULL:
                    self._settle(b, held_tokens(before, i, bs), i)

    def _group(self, ids: list[str], tables: str, pairs: list[tuple[int, int]]) -> list[SeqState]:
        """The sequences a swap moves, after checking that `pairs` (copied and shared) name each
        block of their `tables` once, and no target twice."""
        if len(set(ids)) != len(ids):
            raise InvariantError(f"seq_ids {ids} name a sequence twice")
        group = [self._seq(i) for i in ids]
        firsts = list(dict.fromkeys(b for s in group for t in getattr(s, tables) for b in t if b != NULL))
        if sorted(a for a, _ in pairs) != sorted(firsts):
            raise InvariantError(f"mapping and shared {pairs}: does not cover {', '.join(ids)}'s "
                                 f"{tables.replace('_', ' ')} {firsts}, each block once")
        targets = [t for _, t in pairs]
        if len(set(targets)) != len(targets):
            raise InvariantError(f"mapping and shared {pairs} name a target block twice")
        return group

    def _swap_out(self, ev: p.SwapOut) -> None:
        group = self._group(ev.group, "block_tables", ev.mapping + ev.shared)
        for pairs, held in ((ev.mapping, False), (ev.shared, True)):
            for _, h in pairs:
                self._check_host(h)
                if bool(self.host_ref_counts[h]) != held:
                    raise InvariantError(f"host block {h} is {'not ' if held else 'already '}held")
        to_host, bs = dict(ev.mapping + ev.shared), self.config.block_size
        to_host[NULL] = NULL
        for s in group:
            tables, s.block_tables = s.block_tables, self._new_tables()  # out before `_leave` looks
            for table in tables:
                for i, d in enumerate(table):
                    if d == NULL:
                        continue
                    h = to_host[d]
                    self.host_ref_counts[h] += 1
                    self.host_holder[h] ^= s.key
                    self.host_tokens[h] = max(self.host_tokens[h], held_tokens(s.num_tokens, i, bs))
                    self._leave(d, s, i)
            s.host_tables = [[to_host[d] for d in t] for t in tables]

    def _swap_in(self, ev: p.SwapIn) -> None:
        group = self._group(ev.group, "host_tables", ev.mapping + ev.shared)
        for _, d in ev.shared:
            self._check_block(d)
            if not (self.ref_counts[d] or self.has_hash[d]):
                raise InvariantError(f"block {d} is shared by a swap in, but no sequence holds it "
                                     "and the prefix cache does not keep it")
        to_device, bs = dict(ev.mapping + ev.shared), self.config.block_size
        to_device[NULL] = NULL
        taken = {d for _, d in ev.shared}
        for s in group:
            tables, s.host_tables = s.host_tables, self._new_tables()
            for g, table in enumerate(tables):
                for i, h in enumerate(table):
                    if h == NULL:
                        continue
                    d = to_device[h]
                    if d in taken:  # a block the group shares, one a sibling still holds or one the
                        self._join(d, s)  # prefix cache keeps (its content, found again) is joined
                        self.tokens[d] = max(self.tokens[d], held_tokens(s.num_tokens, i, bs))
                        self.kv_group[d] = g
                    else:
                        self._take_free(d, s, i, g)
                        taken.add(d)
                    self._host_leave(h, s)
            s.block_tables = [[to_device[h] for h in t] for t in tables]
            s.status = "running"

    def _check_offload(self, t: int) -> None:
        if not 0 <= t < len(self.offload_has):
            raise InvariantError(f"host-tier block {t} is outside the host tier of {len(self.offload_has)}")

    def _offload_set(self, t: int, h: str | None, group: int) -> None:
        self._check_offload(t)
        self.offload_has[t], self.offload_group[t] = h is not None, group
        self.offload_hash64[t], canonical = hash_value(h) if h is not None else (0, True)
        if not canonical:
            self.offload_odd[t] = h
        elif self.offload_odd:
            self.offload_odd.pop(t, None)

    def _offload_store(self, ev: p.OffloadStore) -> None:
        self._check_block(ev.block_id)
        self._check_offload(ev.offload_block_id)
        if self.hash_of(ev.block_id) != ev.hash:
            raise InvariantError(f"block {ev.block_id} carries hash {self.hash_of(ev.block_id)}, not {ev.hash}")
        if self.offload_has[ev.offload_block_id]:
            raise InvariantError(f"host-tier block {ev.offload_block_id} is not free "
                                 f"(it holds {self.offload_hash_of(ev.offload_block_id)})")
        self._offload_set(ev.offload_block_id, ev.hash, ev.kv_group)

    def _offload_load(self, ev: p.OffloadLoad) -> None:
        self._check_offload(ev.offload_block_id)
        if self.offload_hash_of(ev.offload_block_id) != ev.hash:
            raise InvariantError(f"host-tier block {ev.offload_block_id} holds "
                                 f"{self.offload_hash_of(ev.offload_block_id)}, not {ev.hash}")
        self._alloc(ev)  # which entries a load filled is history: app/history/mirror.py's `origins`

    def _offload_evict(self, ev: p.OffloadEvict) -> None:
        self._check_offload(ev.offload_block_id)
        if self.offload_hash_of(ev.offload_block_id) != ev.hash:
            raise InvariantError(f"host-tier block {ev.offload_block_id} holds "
                                 f"{self.offload_hash_of(ev.offload_block_id)}, not {ev.hash}")
        self._offload_set(ev.offload_block_id, None, 0)

    def _host_leave(self, h: int, s: SeqState) -> None:
        """`s` stops holding host block h: its tokens are then the most among the holders left."""
        self.host_ref_counts[h] -= 1
        self.host_holder[h] ^= s.key
        if not self.host_ref_counts[h]:
            self.host_holder[h], self.host_tokens[h] = 0, 0
            return
        bs = self.config.block_size
        self.host_tokens[h] = max(held_tokens(t.num_tokens, i, bs) for t in self.seqs.values()
                                  for table in t.host_tables for i, x in enumerate(table) if x == h)

    def _append(self, ev: p.Append) -> None:
        s = self._seq(ev.seq_id)
        bs = self.config.block_size
        if ev.num_tokens > len(s.block_table) * bs:
            raise InvariantError(f"{s.seq_id} holds {ev.num_tokens} tokens in "
                                 f"{len(s.block_table)} blocks of {bs}")
        before = s.num_tokens
        s.num_tokens = ev.num_tokens
        s.output_tokens += len(ev.token_ids)
        s.text += ev.text
        lo, hi = sorted((before, ev.num_tokens))
        for table in s.block_tables:
            for i in range(lo // bs, min(len(table), -(-hi // bs))):  # the blocks whose count moved
                b, held = table[i], held_tokens(ev.num_tokens, i, bs)
                if b == NULL:
                    continue
                if self.has_hash[b]:
                    self.tokens[b] = bs
                elif self.ref_counts[b] == 1:
                    self.tokens[b] = held
                elif ev.num_tokens > before:
                    self.tokens[b] = max(held, self.tokens[b])
                else:
                    self._settle(b, held_tokens(before, i, bs), i)

    def _status(self, ev: p.StatusChange) -> None:
        self._seq(ev.seq_id).status = ev.status

    def _finish(self, ev: p.Finish) -> None:
        s = self._seq(ev.seq_id)
        if s.holds_blocks():
            raise InvariantError(f"{s.seq_id} finishes still holding blocks {s.block_tables}")
        tables, s.host_tables = s.host_tables, self._new_tables()
        for table in tables:  # a swapped sequence's host copies go with it, unless others share them
            for h in table:
                if h != NULL:
                    self._host_leave(h, s)
        del self.seqs[ev.seq_id], self.names[s.key]
        self._mine.discard(ev.seq_id)

    def _step(self, ev: p.StepDone) -> None:
        pass

    def _reset(self, ev: p.Reset) -> None:
        fresh = PoolState.empty(ev.config, self.last_event)
        for name in ("config", *_ARRAYS):
            setattr(self, name, getattr(fresh, name))
        self.seqs, self.names, self._mine = {}, {}, set()
        self.odd_hashes, self.offload_odd = {}, {}


_ARRAYS = ("ref_counts", "has_hash", "hash64", "tokens", "holder", "host_ref_counts",
           "host_holder", "host_tokens", "kv_group", "offload_has", "offload_hash64", "offload_group")

_HANDLERS = {
    p.RequestAdded: PoolState._request_added, p.Fork: PoolState._fork, p.Alloc: PoolState._alloc,
    p.PrefixHit: PoolState._prefix_hit, p.Cached: PoolState._cached, p.Evict: PoolState._evict,
    p.Cow: PoolState._cow, p.Free: PoolState._free, p.WindowFree: PoolState._window_free,
    p.Preempt: PoolState._preempt, p.SwapOut: PoolState._swap_out, p.SwapIn: PoolState._swap_in,
    p.Append: PoolState._append, p.StatusChange: PoolState._status, p.Finish: PoolState._finish,
    p.StepDone: PoolState._step, p.Reset: PoolState._reset, p.OffloadStore: PoolState._offload_store,
    p.OffloadLoad: PoolState._offload_load, p.OffloadEvict: PoolState._offload_evict,
}

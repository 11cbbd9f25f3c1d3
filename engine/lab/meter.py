"""What the lab measures, counted as the allocator emits its events (an EventLog that keeps none).

Per step (sampled at every `step` event, and in bulk for the steps the fast run skips): blocks
in use, tokens held in them, block-table entries. Counted from events: prefix hits and tokens
looked up (`PoolState.prefix_lookup`'s rule), preemptions, swaps.

Tokens held in used blocks are the header's and the reducer's number
(`PoolState.tokens_in_used_blocks`), kept here incrementally because the lab cannot afford the reducer's O(blocks)
per step: held = H - O, where H is the tokens computed by every sequence holding device blocks
and O the tokens counted twice, (holders - 1) x tokens of each shared block. At the end of a step
the holders of a shared block hold it equally (a full block, or a fork's partial last block before
copy-on-write), which is what O uses. tests/integration/test_lab.py checks it against the reducer every step.
"""
from __future__ import annotations

from collections import Counter

from kvscope_contract import protocol as p
from kvscope_contract.counters import EventCounts
from kvscope_contract.lab import PeakGrid
from kvscope_contract.snapshot_codec import hash_hex
from kvscope_contract.state import PoolState, held_tokens, used_blocks
from engine.core.events import EventLog

# events that can change what the scheduler's queued part decides (admission, swap-in)
CHANGES = frozenset({p.RequestAdded, p.Fork, p.Alloc, p.PrefixHit, p.Cached, p.Evict, p.Cow, p.Free,
                     p.Preempt, p.SwapOut, p.SwapIn, p.StatusChange, p.Finish, p.OffloadLoad})


class Meter(EventLog):
    def __init__(self, keep: bool = False):
        super().__init__()
        self.keep = keep                  # keep the events (the step-by-step reference run)
        self.core = None                  # the EngineCore whose events these are (bound after it is built)
        self.changes = 0                  # events of a CHANGES kind so far
        self.held = 0                     # H: tokens computed by sequences that hold device blocks
        self.overlap = 0                  # O: tokens of shared blocks counted more than once in H
        self.entries = 0                  # block-table entries of every sequence
        self.counts = EventCounts()       # hits, lookups, preemptions, swaps: the contract's fold
        self.first_hit = self.first_looked_up = 0  # the same at first admissions (vLLM's counters)
        self.recomputed: set[str] = set()  # live sequences preempted by recompute: their admissions are not first
        self.loaded: dict[str, int] = {}  # tokens the admission under way loaded from the host tier, by sequence
        self.admission_loaded = 0  # of the last admission
        self.computed = 0
        self.finished = 0
        self.steps = 0
        self.sum_used = self.sum_held = self.sum_entries = 0
        self.peak_used = self.peak_entries = 0
        self.peak: tuple | None = None    # (step, ref counts, hashed flags, [(table, computed)])
        self.entered: list[str] = []      # sequences that joined the running ones (admitted, swapped in, forked)
        self.lag = None                   # seq -> tokens computed but not yet applied (the fast run's steady sequences)

    def bind(self, core) -> None:
        self.core = core
        self.bs = core.block_manager.block_size
        self.caching = core.block_manager.config.enable_prefix_caching

    # ------------------------------------------------------------------ events
    def emit(self, ev: p.Event) -> None:
        self.seq += 1
        ev.seq, ev.step = self.seq, self.step
        if self.keep:
            self.pending.append(ev)
        changes, handler = _ON.get(type(ev), _NOTHING)
        self.changes += changes
        if handler is not None:
            handler(self, ev)

    def _seq(self, seq_id: str):
        return self.core.seqs[seq_id]

    def _request_added(self, ev) -> None:
        pass

    def _alloc(self, ev: p.Alloc) -> None:
        self.entries += 1

    def _offload_load(self, ev: p.OffloadLoad) -> None:
        """A new entry, like an alloc; its tokens are computed at admission but are no prefix-cache hit."""
        self.entries += 1
        self.counts.count(ev)
        self.loaded[ev.seq_id] = self.loaded.get(ev.seq_id, 0) + self.bs

    def _prefix_hit(self, ev: p.PrefixHit) -> None:
        self.entries += 1
        if self.core.block_manager.pool.ref_counts[ev.block_id] > 1:
            self.overlap += self.bs

    def _status(self, ev: p.StatusChange) -> None:  # an admission: the lookup is done, its hits computed
        seq = self._seq(ev.seq_id)
        self.entered.append(ev.seq_id)
        if self.caching:  # every token it holds was looked up (the rule of PoolState.prefix_lookup)
            self.counts.looked_up_tokens += len(seq)
            self.admission_loaded = self.loaded.pop(ev.seq_id, 0)
            hit = seq.num_computed_tokens - self.admission_loaded  # the device's: not the host tier's
            self.counts.hit_tokens += hit  # the admission's hit, every group's once
            if ev.seq_id not in self.recomputed:
                self.first_looked_up += len(seq)
                self.first_hit += hit
        self.held += seq.num_computed_tokens

    def _fork(self, ev: p.Fork) -> None:
        parent = self._seq(ev.parent_seq_id)
        c, bs = parent.num_computed_tokens, self.bs
        self.entries += len(ev.block_ids)
        self.entered.append(ev.seq_id)
        self.held += c
        self.overlap += sum(held_tokens(c, i, bs) for i in range(len(ev.block_ids)))

    def _cow(self, ev: p.Cow) -> None:
        self.overlap -= held_tokens(self._seq(ev.seq_id).num_computed_tokens, ev.logical_index, self.bs)

    def _free(self, ev: p.Free) -> None:
        self.entries -= 1
        seq = self._seq(ev.seq_id)
        if ev.ref_count:
            self.overlap -= held_tokens(seq.num_computed_tokens, len(seq.block_table), self.bs)
        if not seq.block_table:
            self.held -= seq.num_computed_tokens

    def _preempt(self, ev: p.Preempt) -> None:
        self.counts.count(ev)
        if ev.mode == "recompute":
            self.recomputed.add(ev.seq_id)

    def _swap_out(self, ev: p.SwapOut) -> None:
        refs, bs = self.core.block_manager.pool.ref_counts, self.bs
        to_device = {h: d for d, h in ev.mapping + ev.shared}
        self.counts.count(ev)
        left: set[int] = set()
        for seq in map(self._seq, ev.group):  # their tables are on the host now
            c = seq.num_computed_tokens
            self.entries -= len(seq.host_table)
            self.held -= c
            for i, h in enumerate(seq.host_table):  # every holder that left but the last leaves
                d = to_device[h]                     # others behind; the last, if some stayed
                if d in left or refs[d]:
                    self.overlap -= held_tokens(c, i, bs)
                left.add(d)

    def _swap_in(self, ev: p.SwapIn) -> None:
        self.counts.count(ev)
        refs, back = self.core.block_manager.pool.ref_counts, Counter()
        for seq in map(self._seq, ev.group):
            back.update(seq.block_table)
        # held before (not a block found again in the prefix cache): every holder coming back adds overlap
        joined = {d for _, d in ev.shared if refs[d] > back[d]}
        for seq in map(self._seq, ev.group):
            c = seq.num_computed_tokens
            self.entered.append(seq.seq_id)
            self.entries += len(seq.block_table)
            self.held += c
            for i, d in enumerate(seq.block_table):
                if d in joined:
                    self.overlap += held_tokens(c, i, self.bs)
                joined.add(d)

    def _finish(self, ev: p.Finish) -> None:
        self.finished += 1
        self.recomputed.discard(ev.seq_id)

    def _step(self, ev: p.StepDone) -> None:
        self.sample(1, 0)

    # ------------------------------------------------------------------ steps
    def computed_rows(self, num_tokens: int) -> None:
        """Tokens a step computes (they land in blocks only their sequence holds)."""
        self.held += num_tokens
        self.computed += num_tokens

    @property
    def used(self) -> int:
        bm = self.core.block_manager
        return used_blocks(bm.config, bm.num_free_blocks, bm.num_cached_blocks)

    @property
    def tokens_in_used(self) -> int:
        return self.held - self.overlap

    def sample(self, steps: int, steady: int) -> None:
        """The end of `steps` steps in which `steady` sequences computed one token each and
        nothing else changed (steps=1, steady=0: the step just done)."""
        used, held = self.used, self.tokens_in_used
        self.sum_used += used * steps
        self.sum_held += held * steps + steady * steps * (steps + 1) // 2
        self.sum_entries += self.entries * steps
        self.held += steady * steps
        self.computed += steady * steps
        self.steps += steps
        self.peak_entries = max(self.peak_entries, self.entries)
        if used > self.peak_used:
            self.peak_used = used
            self._capture()

    def _capture(self) -> None:
        """The pool as it is now, cheaply (lists copied at C speed); drawn only at the end."""
        bm, lag = self.core.block_manager, self.lag
        seqs = [([list(t) for t in s.block_tables], s.num_computed_tokens + (lag(s) if lag else 0))
                for s in self.core.seqs.values() if any(s.block_tables)]
        self.peak = (self.step, bm.pool.ref_counts[:], bm.cache.hashes[:], seqs)

    def peak_grid(self) -> PeakGrid | None:
        """The captured peak, through the reducer's own block rules (via a snapshot, its stable form)."""
        if self.peak is None:
            return None
        step, refs, hashes, seqs = self.peak
        cfg = self.core.block_manager.config
        snap = p.Snapshot(
            seq=0, config=cfg, host_blocks=[p.HostBlock(i, None, 0) for i in range(cfg.num_host_blocks)],
            device_blocks=[p.DeviceBlock(i, r, None if h is None else hash_hex(h), 0)
                           for i, (r, h) in enumerate(zip(refs, hashes))],
            seqs=[p.SeqInfo(seq_id=str(i), request_id=str(i), status="running", block_table=tables[0], host_table=[],
                            num_tokens=computed, prompt_tokens=0, output_tokens=0,
                            block_tables=tables if len(tables) > 1 else [],
                            host_tables=[[] for _ in tables] if len(tables) > 1 else [])
                  for i, (tables, computed) in enumerate(seqs)])
        state = PoolState.from_snapshot(snap)
        return PeakGrid(step=step, states=state.block_states().tolist(), tokens=state.block_tokens()[0].tolist())


_HANDLERS = {
    p.Alloc: Meter._alloc, p.PrefixHit: Meter._prefix_hit, p.StatusChange: Meter._status,
    p.Fork: Meter._fork, p.Cow: Meter._cow, p.Free: Meter._free, p.Preempt: Meter._preempt,
    p.SwapOut: Meter._swap_out, p.SwapIn: Meter._swap_in, p.Finish: Meter._finish, p.StepDone: Meter._step,
    p.OffloadLoad: Meter._offload_load,
    p.OffloadStore: lambda m, ev: m.counts.count(ev), p.OffloadEvict: lambda m, ev: m.counts.count(ev),
}
_ON = {kind: (kind in CHANGES, _HANDLERS.get(kind)) for kind in p.AnyEvent.__args__}
_NOTHING = (False, None)


class HybridMeter(Meter):
    """The meter for a pool of several KV-cache groups, where a sequence's tokens sit in a table
    per group and a sliding window empties the front of some: tokens in used blocks and table
    entries are counted afresh at each step (O(entries): the lab runs such pools step by step)."""

    @property
    def tokens_in_used(self) -> int:
        held: dict[int, int] = {}
        bs = self.bs
        for s in self.core.seqs.values():
            c = s.num_computed_tokens
            for table in s.block_tables:
                for i, b in enumerate(table):
                    if b >= 0:
                        held[b] = max(held.get(b, 0), held_tokens(c, i, bs))
        hashes = self.core.block_manager.cache.hashes
        return sum(bs if hashes[b] is not None else t for b, t in held.items())

    def emit(self, ev: p.Event) -> None:
        self.seq += 1
        ev.seq, ev.step = self.seq, self.step
        if self.keep:
            self.pending.append(ev)
        self.changes += type(ev) in CHANGES
        match ev:
            case p.StatusChange():
                Meter._status(self, ev)
            case p.Preempt():
                Meter._preempt(self, ev)
            case p.SwapOut() | p.SwapIn():
                self.counts.count(ev)
            case p.Finish():
                Meter._finish(self, ev)
            case p.StepDone():
                self.sample(1, 0)

    def computed_rows(self, num_tokens: int) -> None:
        self.computed += num_tokens

    def sample(self, steps: int, steady: int) -> None:
        self.entries = sum(b >= 0 for s in self.core.seqs.values() for t in s.block_tables for b in t)
        super().sample(steps, steady)

"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step: running sequences first (a decode token, or the next chunk of a prefill), preempting
the latest arrival when blocks run out (by swap, together with its request's other samples not
yet scheduled in the step, so the blocks they share are copied once); then, if nothing was
preempted, swapped sequences come back (a request's samples together); then, if none is left
swapped, waiting ones are admitted first come, first served (a sequence preempted by recompute
goes back to the front), all under `max_num_seqs` sequences (a request's samples count before
they fork) and `max_num_batched_tokens` tokens. Admission stops at the first waiting sequence
that does not fit, so a long prompt is never overtaken. `long_prefill_token_threshold` (vLLM's
name; 0, the default, is off) caps one sequence's prefill chunk a step, so a long prompt leaves
budget for others to be admitted while it is still being prefilled.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from kvscope_contract import protocol as p
from engine.core.block_manager import BlockManager
from engine.core.events import EventLog
from engine.core.sequence import Sequence, SeqStatus


@dataclass
class Scheduled:
    """One sequence's share of a step: `num_tokens` of its tokens to compute."""
    seq: Sequence
    num_tokens: int  # computed this step, from seq.num_computed_tokens on
    completes: bool = field(init=False)  # the chunk reaches the end: a token is sampled after it

    def __post_init__(self) -> None:
        self.completes = self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass
class Batch:
    """What one step runs: the block copies to make first (swap-out, swap-in, copy-on-write,
    in that order) and the rows to compute. False when there is nothing to run."""
    rows: list[Scheduled] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) to copy first
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    copies: list[tuple[int, int]] = field(default_factory=list)    # copy-on-write (src, dst)
    loads: list[tuple[int, int]] = field(default_factory=list)   # (host tier, device) before the forward
    stores: list[tuple[int, int]] = field(default_factory=list)  # (device, host tier) after it

    def __bool__(self) -> bool:
        return bool(self.rows or self.swap_out or self.swap_in)


class Scheduler:
    """Three queues (waiting, running, swapped) and the rule that moves sequences between them
    each step; every block it needs comes from the BlockManager, every status change it makes
    is emitted (`status_change`, `preempt`; the block events come from the BlockManager).

    Promises, after `schedule` returns:
    - Every sequence in the batch holds blocks for every token it will have computed after the
      step, its last block writable (the copy-on-write listed in `Batch.copies`).
    - Admission (allocate, swap-in) never takes the pool below the BlockManager's watermark;
      a running sequence that cannot grow preempts the latest arrival instead (itself, if it
      is the latest), by swap when the pool's mode is swap and the host pool has room, else by
      recompute (its blocks freed, back to the front of the waiting queue).
    - At most `max_num_seqs` sequences run (samples yet to fork count) and at most
      `max_num_batched_tokens` tokens are computed.
    """

    def __init__(self, bm: BlockManager, log: EventLog, max_num_batched_tokens: int):
        self.bm, self.log = bm, log
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = 0  # a prefill chunk's most tokens a step (0: no cap)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self._arrivals = 0

    @property
    def max_num_seqs(self) -> int:
        """The most sequences in one step (the pool config's, so a reset changes it)."""
        return self.bm.config.max_num_seqs

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue; it holds no block yet.

        Args:
            seq: a new sequence (its request's first sample: the others fork from it later).
        """
        self._arrivals += 1
        seq.arrival = self._arrivals
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Whether any sequence is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped)

    def add_running(self, seq: Sequence) -> None:
        """Running sequences stay in arrival order, so preemption always takes the newest."""
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it (it finished or was aborted).

        Args:
            seq: a waiting, running or swapped sequence (its blocks are the caller's to free).
        """
        queue = {SeqStatus.WAITING: self.waiting, SeqStatus.RUNNING: self.running,
                 SeqStatus.SWAPPED: self.swapped}[seq.status]
        queue.remove(seq)

    def schedule(self) -> Batch:
        """The next step: running sequences first, then (if none was preempted) the queued
        ones. Blocks are allocated, copied on write, swapped and cached as it decides.

        Returns:
            The Batch: which copies the model runner must make first and which tokens to compute.
        """
        batch = Batch()
        budget, preempted = self.schedule_running(batch, self.max_num_batched_tokens)
        if not preempted:
            self.schedule_queued(batch, budget)
        if self.bm.offload is not None:
            batch.loads, batch.stores = self.bm.offload.take_copies()
        return batch

    def schedule_running(self, batch: Batch, budget: int) -> tuple[int, bool]:
        """Running sequences in arrival order, preempting the latest arrival when one cannot grow.

        Args:
            batch: the step's batch, filled in place.
            budget: tokens the step may still compute.
        Returns:
            The budget left, and whether any sequence was preempted.
        """
        preempted = False
        i = 0
        while i < len(self.running) and budget:
            seq = self.running[i]
            self.bm.free_window(seq)
            while not self.bm.can_append(seq, self.chunk(seq, budget)):
                gone = self._preempt(self.running[-1], i, batch)  # the latest arrival gives way
                preempted = True
                if seq in gone:
                    break
            else:
                budget -= self.schedule_seq(seq, budget, batch)
                i += 1
        return budget, preempted

    def schedule_queued(self, batch: Batch, budget: int) -> int:
        """Swapped sequences come back first; waiting ones are admitted only once none is left
        swapped.

        Args:
            batch: the step's batch, filled in place.
            budget: tokens the step may still compute.
        Returns:
            The budget left.
        """
        seats = sum(map(_width, self.running))  # taken in the batch, samples yet to fork included
        while self.swapped and budget:
            group = self._group(self.swapped, self.swapped[0])
            if self.running and seats + sum(map(_width, group)) > self.max_num_seqs:
                break
            if not self.bm.can_swap_in(group):
                break
            for seq in group:
                self.swapped.remove(seq)
            batch.swap_in += self.bm.swap.swap_in(group)
            for seq in group:
                self.add_running(seq)
                seats += _width(seq)
            for seq in group:
                if budget and self.bm.can_append(seq, self.chunk(seq, budget)):
                    budget -= self.schedule_seq(seq, budget, batch)
        if not self.swapped:
            while self.waiting and budget:
                seq = self.waiting[0]
                if self.running and seats + _width(seq) > self.max_num_seqs:
                    break
                first = min(budget, self.long_prefill_token_threshold or budget)  # its first chunk at most
                if not self.bm.can_allocate(seq, first):
                    break
                self.waiting.popleft()
                seq.num_computed_tokens = self.bm.allocate(seq, first)
                self.log.emit(p.StatusChange(seq_id=seq.seq_id, status="running"))
                self.add_running(seq)
                seats += _width(seq)
                budget -= self.schedule_seq(seq, budget, batch)
        return budget

    def schedule_seq(self, seq: Sequence, budget: int, batch: Batch) -> int:
        """Schedule up to `budget` of the tokens `seq` still has to compute; returns how many.
        Frees the blocks its sliding windows have passed, makes its last block writable in every
        group (a new block, or copy-on-write into `batch.copies`) and offers the blocks those
        tokens fill to the prefix cache.

        Args:
            seq: a running sequence holding blocks for all its tokens.
            budget: tokens the step may still compute (a prefill longer than that is chunked).
            batch: the step's batch, filled in place.
        Returns:
            The tokens scheduled.
        """
        n = self.chunk(seq, budget)
        self.bm.free_window(seq)
        batch.copies += self.bm.append_slot(seq, n)
        self.bm.cache_full_blocks(seq, seq.num_computed_tokens + n)
        batch.rows.append(Scheduled(seq, n))
        return n

    def chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens of `seq` the step computes with `budget` left: all it has to compute, at most
        the budget and (a prefill) `long_prefill_token_threshold`."""
        n = min(len(seq) - seq.num_computed_tokens, budget)
        cap = self.long_prefill_token_threshold
        return min(n, cap) if cap else n

    def _preempt(self, victim: Sequence, scheduled: int, batch: Batch) -> list[Sequence]:
        """Preempt `victim` (the last running sequence); by swap, together with the samples of
        its request behind the one being scheduled (`running[scheduled]`, which keeps running
        unless it is the victim), so the blocks they share are copied once and stay shared on
        the host, as vLLM v0 swapped a sequence group. Returns the sequences preempted, now out
        of `running`."""
        swap_mode = self.bm.config.preemption_mode == "swap"
        group = self._group(self.running[scheduled + 1:], victim)
        if swap_mode and self.bm.can_swap_out(group):
            for seq in group:
                self.running.remove(seq)
                self.log.emit(p.Preempt(seq_id=seq.seq_id, mode="swap"))
                seq.status = SeqStatus.SWAPPED
                self.swapped.append(seq)
            batch.swap_out += self.bm.swap.swap_out(group)
            return group
        # recompute, or the host pool is full
        self.running.remove(victim)
        self.log.emit(p.Preempt(seq_id=victim.seq_id, mode="recompute",
                                reason="host_pool_full" if swap_mode else None))
        self.bm.free(victim)
        victim.num_computed_tokens = 0
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)
        return [victim]

    @staticmethod
    def _group(queue, seq: Sequence) -> list[Sequence]:
        """`seq` and the other sequences of its request in `queue`, in queue order."""
        return [s for s in queue if s.request_id == seq.request_id] if seq in queue else [seq]


def _width(seq: Sequence) -> int:
    """Sequences `seq` will take in the running batch: before its first token, its samples
    are still to fork from it."""
    return seq.params.n if seq.num_output_tokens == 0 else 1

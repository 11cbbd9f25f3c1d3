"""Plays the scheduler's part around a BlockManager, so tests can drive the pools directly.

It emits the request-level events (request_added, status, append, preempt, finish) the way
the engine does, and stands in for the model: a "forward" just marks tokens computed and
samples the next token from the caller.
"""
from __future__ import annotations

import random

from kvscope_contract import protocol as p
from engine.core.block_manager import BlockManager
from engine.core.events import EventLog
from engine.core.sequence import SamplingParams, Sequence, SeqStatus
from kvscope_contract.state import PoolState


class PoolDriver:
    def __init__(self, config: p.PoolConfig):
        self.log = EventLog()
        self.bm = BlockManager(config, self.log)
        self.seqs: dict[str, Sequence] = {}
        self.events: list[p.Event] = []
        self.first = self.snapshot()
        self._ids = 0

    # ------------------------------------------------------------------ observation
    def state(self) -> PoolState:
        return self.bm.state(self.seqs.values())

    def snapshot(self) -> p.Snapshot:
        return self.state().snapshot()

    def drain(self) -> list[p.Event]:
        new = self.log.drain()
        self.events.extend(new)
        return new

    def replay(self) -> PoolState:
        state = PoolState.from_snapshot(self.first)
        for ev in self.events + self.log.pending:
            state.apply(ev)
        return state

    def with_status(self, status: SeqStatus) -> list[Sequence]:
        return [s for s in self.seqs.values() if s.status is status]

    # ------------------------------------------------------------------ requests
    def add(self, tokens: list[int], max_tokens: int = 64) -> Sequence:
        self._ids += 1
        rid = f"r{self._ids}"
        seq = Sequence(rid, rid, list(tokens), SamplingParams(max_tokens=max_tokens),
                       block_tables=self.bm.new_tables(), host_tables=self.bm.new_tables())
        self.seqs[rid] = seq
        self.log.emit(p.RequestAdded(request_id=rid, seq_id=rid, prompt_tokens=len(tokens),
                                     max_tokens=max_tokens, prompt_token_texts=[f"<{t}>" for t in tokens]))
        return seq

    def random_op(self, rng: random.Random, prefixes: list[list[int]], vocab: int = 4) -> None:
        """One operation of a random trace: admit a request (often starting with a shared
        prefix), decode (swapping out or recomputing when the pool is full), fork, finish,
        bring back a swapped or waiting sequence, or clear the prefix cache."""
        running = self.with_status(SeqStatus.RUNNING)
        roll = rng.random()
        if roll < 0.15 or not running:
            prefix = prefixes[rng.randrange(len(prefixes))][:rng.randrange(33)]
            seq = self.add(prefix + [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))])
            if not self.admit(seq):
                waiting = self.with_status(SeqStatus.WAITING)
                if len(waiting) > 4:
                    self.finish(waiting[0], "abort")
        elif roll < 0.70:
            seq = rng.choice(running)
            group = self.family(seq, SeqStatus.RUNNING) if rng.random() < 0.5 else [seq]
            self.bm.free_window(seq)
            if self.bm.can_append(seq):
                self.decode(seq, rng.randrange(vocab))
            elif self.bm.can_swap_out(group):
                self.swap_out(group)
            else:
                self.recompute(seq)
        elif roll < 0.75:
            self.fork(rng.choice(running))
        elif roll < 0.88:
            self.finish(rng.choice(running))
        elif roll < 0.95:
            for seq in self.with_status(SeqStatus.SWAPPED)[:1]:
                group = self.family(seq, SeqStatus.SWAPPED)[:rng.randrange(1, 4)]  # at times a part
                if seq not in group:
                    group = [seq]
                if self.bm.can_swap_in(group):
                    self.swap_in(group)
            for seq in self.with_status(SeqStatus.WAITING)[:1]:
                self.admit(seq, rng.randrange(vocab))
        else:
            self.bm.clear_prefix_cache()

    def admit(self, seq: Sequence, next_token: int = 1) -> bool:
        """Allocate a waiting sequence (prefix hits first) and run its prefill."""
        if not self.bm.can_allocate(seq):
            return False
        self.bm.allocate(seq)
        self._set_status(seq, SeqStatus.RUNNING)
        self.bm.cache_full_blocks(seq, len(seq))
        self._computed(seq, len(seq), next_token)
        return True

    def decode(self, seq: Sequence, next_token: int = 1) -> list[tuple[int, int]]:
        """One decode step: the blocks its windows passed freed, room for the pending token,
        compute it, sample the next; returns the copies on write."""
        self.bm.free_window(seq)
        assert self.bm.can_append(seq)
        cow = self.bm.append_slot(seq)
        self.bm.cache_full_blocks(seq, len(seq))
        self._computed(seq, len(seq), next_token)
        return cow

    def fork(self, parent: Sequence) -> Sequence:
        self._ids += 1
        child = Sequence(f"{parent.seq_id}.{self._ids}", parent.request_id, list(parent.token_ids),
                         parent.params, parent.num_prompt_tokens, parent.status,
                         num_computed_tokens=parent.num_computed_tokens, text=parent.text,
                         host_tables=self.bm.new_tables())
        self.seqs[child.seq_id] = child
        self.bm.fork(parent, child)
        return child

    def finish(self, seq: Sequence, reason: p.FinishReason = "stop") -> None:
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        del self.seqs[seq.seq_id]
        self.log.emit(p.Finish(seq_id=seq.seq_id, reason=reason))

    def swap_out(self, group: Sequence | list[Sequence]) -> list[tuple[int, int]]:
        """Swap out a sequence, or several together (a fork group: shared blocks copied once)."""
        group = group if isinstance(group, list) else [group]
        for seq in group:
            self.log.emit(p.Preempt(seq_id=seq.seq_id, mode="swap"))
            seq.status = SeqStatus.SWAPPED
        return self.bm.swap.swap_out(group)

    def swap_in(self, group: Sequence | list[Sequence]) -> list[tuple[int, int]]:
        group = group if isinstance(group, list) else [group]
        mapping = self.bm.swap.swap_in(group)
        for seq in group:
            seq.status = SeqStatus.RUNNING
        return mapping

    def family(self, seq: Sequence, status: SeqStatus) -> list[Sequence]:
        """`seq`'s request's sequences of `status`, in creation order."""
        return [s for s in self.seqs.values() if s.request_id == seq.request_id and s.status is status]

    def recompute(self, seq: Sequence) -> None:
        self.log.emit(p.Preempt(seq_id=seq.seq_id, mode="recompute"))
        seq.status = SeqStatus.WAITING
        self.bm.free(seq)
        seq.num_computed_tokens = 0

    def _set_status(self, seq: Sequence, status: SeqStatus) -> None:
        seq.status = status
        self.log.emit(p.StatusChange(seq_id=seq.seq_id, status=status.value))

    def _computed(self, seq: Sequence, num_tokens: int, next_token: int) -> None:
        seq.num_computed_tokens = num_tokens
        seq.token_ids.append(next_token)
        self.log.emit(p.Append(seq_id=seq.seq_id, num_tokens=num_tokens, token_ids=[next_token],
                               text=f"<{next_token}>"))
        seq.text += f"<{next_token}>"

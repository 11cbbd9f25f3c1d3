"""One workload through the real BlockManager and Scheduler under one config, outputs replayed.

No model: `EngineCore` runs as in the engine, with each sample's next token taken from the
workload. Two ways to run it, with equal results (tests/integration/test_lab.py):

- `stepwise`: `EngineCore.step()` every step, every event, like the live engine;
- `fast` (the default): event-driven. A decoding sequence whose next step neither needs a block
  (a new one, or a copy of a shared one), nor registers a full block, nor finishes is *steady*:
  that step changes nothing in the pools but its token count. The fast run keeps, per running
  sequence, the step at which it next needs attention (a heap) and runs only those sequences
  through the scheduler (`Scheduler.schedule_seq`, and `schedule_queued` for swap-ins and
  admissions); steady ones catch up on their tokens lazily when next touched. Steps where nobody
  needs attention and the queues cannot move are skipped in one go. Whenever the shortcut's
  premises fail (a prefill does not fit the step's token budget, or the blocks needed exceed
  what the pool can give, so someone would be preempted) the step runs in full.

A pool of several KV-cache groups (a hybrid model's), or with a sliding window, always runs step
by step: its windows free blocks between the steps the shortcut would skip.
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque

from kvscope_contract import protocol as p
from kvscope_contract.lab import LabConfig, LabRow
from engine.core.engine_core import EngineCore
from engine.lab.meter import HybridMeter, Meter
from engine.lab.workload import Request, Workload
from engine.core.scheduler import Batch
from engine.core.sequence import SamplingParams, Sequence, SeqStatus


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Lab(EngineCore):
    meter_class: type[Meter] = Meter  # what counts a full-attention pool's events (a trace replay adds its own)

    def __init__(self, config: LabConfig, workload: Workload, keep_events: bool = False):
        groups = config.pool.groups
        self.windowed = len(groups) > 1 or groups[0].window is not None  # several tables, or a window
        self.meter = (HybridMeter if self.windowed else self.meter_class)(keep=keep_events)
        super().__init__(config.pool, config.max_num_batched_tokens, config.watermark, log=self.meter)
        self.meter.bind(self)
        self.config, self.workload = config, workload
        self.streams: dict[str, list[int]] = {}  # seq_id -> the output tokens it will produce
        self._outputs: dict[str, list[list[int]]] = {}
        self.rejected: list[str] = []
        # fast run
        self._due: list[tuple[int, int, Sequence]] = []  # (step, ticket, seq)
        self._version: dict[Sequence, int] = {}  # the ticket of a sequence's live heap entry
        self._ends: dict[Sequence, int] = {}
        self._bs = config.pool.block_size
        self._caching = config.pool.enable_prefix_caching
        self._refs = self.block_manager.pool.ref_counts
        self._anchor: dict[Sequence, int] = {}  # first step whose token a steady sequence has not applied
        self._ticket = 0
        self._queued_key: tuple[int, int] | None = None  # (changes, budget) of the last queued pass that moved nothing

    # ------------------------------------------------------------------ the model's part, replayed
    def _track(self, seq: Sequence, index: int) -> None:
        super()._track(seq, index)
        stream = self.streams[seq.seq_id] = self._outputs[seq.request_id][index]
        # the length at which it samples its last token
        self._ends[seq] = seq.num_prompt_tokens + min(len(stream), seq.params.max_tokens) - 1

    def _sample(self, seq: Sequence, payload) -> int:
        return self.streams[seq.seq_id][seq.num_output_tokens]

    def _stops(self, seq: Sequence, token: int) -> bool:
        """The stream ran out before max tokens: it stopped there (end of text, or an abort)."""
        return seq.num_output_tokens >= len(self.streams[seq.seq_id]) < seq.params.max_tokens

    def _postprocess(self, batch: Batch, payloads):
        self.meter.computed_rows(sum(row.num_tokens for row in batch.rows))
        return super()._postprocess(batch, payloads)

    def _add(self, req: Request) -> None:
        self._outputs[req.request_id] = req.outputs
        # the stream ends the sequence ("stop"); max_tokens only bounds it, as in the recording
        params = SamplingParams(max_tokens=req.max_tokens, n=req.n)
        try:
            self.add_tokens(req.prompt, params, req.request_id)
        except p.CommandError:
            self.rejected.append(req.request_id)

    # ------------------------------------------------------------------ running
    def run(self, fast: bool = True, pending=None) -> LabRow:
        """Run the workload to its end. `pending`: the requests instead, in arrival order, as
        anything with `popleft()`, `[0]` and truthiness whose items have `.arrival` and go to
        `_add` (a trace streams its requests this way, engine/lab/trace_replay.py)."""
        if pending is None:
            pending = deque(sorted(self.workload.requests, key=lambda r: r.arrival))
        fast = fast and not self.windowed
        if fast:
            self.meter.lag = self._lag
        while pending or self.scheduler.has_work():
            # a request submitted after step a joins before step a + 1, or at once when idle
            while pending and (pending[0].arrival <= self.log.step or not self.scheduler.has_work()):
                self._add(pending.popleft())
            if not self.scheduler.has_work():
                continue
            if not fast:
                self.step()
            elif not self._fast_step():
                nxt = pending[0].arrival + 1 if pending else None
                self._skip(nxt)
        return self._row()

    def _row(self) -> LabRow:
        m = self.meter
        steps = max(1, m.steps)
        return LabRow(
            config=self.config, steps=m.steps, peak_used=m.peak_used, mean_used=m.sum_used / steps,
            slot_util=m.sum_held / (m.sum_used * self.block_manager.block_size) if m.sum_used else 1.0,
            **m.counts.lab_fields(), computed_tokens=m.computed, peak_entries=m.peak_entries,
            mean_entries=m.sum_entries / steps, finished=m.finished, rejected=self.rejected,
            peak=m.peak_grid(), first_hit_tokens=m.first_hit, first_looked_up_tokens=m.first_looked_up)

    # ------------------------------------------------------------------ the fast run
    def _lag(self, seq: Sequence) -> int:
        a = self._anchor.get(seq)
        return 0 if a is None else max(0, self.log.step + 1 - a)

    def _materialize(self, seq: Sequence, step: int) -> None:
        """Apply the tokens a steady sequence computed in steps [anchor, step)."""
        a = self._anchor.get(seq)
        if a is not None and step > a:
            m, o = step - a, len(seq.token_ids) - seq.num_prompt_tokens
            seq.token_ids += self.streams[seq.seq_id][o:o + m]
            seq.num_computed_tokens += m
        self._anchor[seq] = step

    def _push(self, seq: Sequence, step: int) -> None:
        """Schedule `seq` (running, its tokens applied up to `step`) for the step it next needs attention."""
        bs = self._bs
        n, table = len(seq.token_ids), seq.block_table
        due = step
        if seq.num_computed_tokens == n - 1:  # decoding: one pending token per step
            last = (n - 1) // bs
            if last >= len(table) or self._refs[table[last]] == 1:
                k = len(table) * bs + 1 - n                                       # needs a new block
                if self._caching:
                    k = min(k, (seq.num_registered_blocks + 1) * bs - n)         # registers a full block
                k = min(k, self._ends[seq] - n)                                  # samples its last token
                due = step + max(0, k)
        self._anchor[seq] = step
        self._ticket += 1
        self._version[seq] = self._ticket
        heapq.heappush(self._due, (due, self._ticket, seq))

    def _pop_due(self, step: int) -> list[Sequence]:
        due, heap, version, running = [], self._due, self._version, SeqStatus.RUNNING
        while heap and heap[0][0] <= step:
            _, ticket, seq = heapq.heappop(heap)
            if version.get(seq) == ticket and seq.status is running:
                due.append(seq)
        return due

    def _next_due(self) -> int | None:
        heap, version, running = self._due, self._version, SeqStatus.RUNNING
        while heap and not (version.get(heap[0][2]) == heap[0][1] and heap[0][2].status is running):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _queued_blocked(self, budget: int) -> bool:
        """Whether the queued part of the scheduler provably moves nothing: it moved nothing
        last time, and no event since could change its answer."""
        s = self.scheduler
        return not (s.waiting or s.swapped) or self._queued_key == (self.meter.changes, budget)

    def _order(self, seqs: list[Sequence]) -> list[Sequence]:
        """`seqs` in the order of `running`: by arrival, and samples of one request (which
        share it) in the order they joined."""
        seqs.sort(key=_arrival)
        if any(a.arrival == b.arrival for a, b in zip(seqs, seqs[1:])):
            running = self.scheduler.running
            start = {s: bisect.bisect_left(running, s.arrival, key=_arrival) for s in seqs}
            seqs.sort(key=lambda s: running.index(s, start[s]))
        return seqs

    def _skip(self, next_arrival: int | None) -> None:
        """Nobody needs attention at the next step and the queues cannot move: jump to the next
        step where something happens, every running sequence computing a token per step."""
        step = self.log.step + 1
        targets = [t for t in (self._next_due(), next_arrival) if t is not None]
        if not targets:  # nothing running and nothing can be admitted: cannot happen, but never spin
            raise RuntimeError("the lab's scheduler is stuck: requests wait that nothing can admit")
        k = max(1, min(targets) - step)
        self.log.step += k
        self.meter.sample(k, len(self.scheduler.running))

    def _fast_step(self) -> bool:
        """Run the next step if anything happens in it; False when it would change nothing."""
        step = self.log.step + 1
        sched, bm = self.scheduler, self.block_manager
        budget_all = self.max_num_batched_tokens
        running = sched.running
        due = self._pop_due(step)
        if not due and self._queued_blocked(budget_all - len(running)):
            return False
        tokens, blocks = len(running) - len(due), 0
        for seq in due:
            self._materialize(seq, step)
            tokens += sched.chunk(seq, budget_all)
            blocks += bm.blocks_to_append(seq)
        if tokens > budget_all or blocks > bm.num_allocatable_blocks:
            self._full_step(step)
            return True
        self.log.step = step
        batch = Batch()
        for seq in self._order(due) if len(due) > 1 else due:
            sched.schedule_seq(seq, budget_all, batch)  # everything fits: budget does not bind
        budget = budget_all - tokens
        steady = len(running) - len(due)  # before the queued part adds any
        self.meter.entered.clear()
        if not self._queued_blocked(budget):
            before = self.meter.changes
            sched.schedule_queued(batch, budget)
            self._queued_key = (self.meter.changes, budget) if self.meter.changes == before else None
        self._postprocess(batch, None)
        if bm.offload is not None:  # no copies to make here: the step's stores are loadable from the next on
            bm.offload.take_copies()
            bm.offload.end_step()
        touched = due + [r.seq for r in batch.rows[len(due):]] + [self.seqs[i] for i in self.meter.entered
                                                                   if i in self.seqs]
        pushed = set()
        for seq in touched:
            if seq.status is SeqStatus.RUNNING and seq not in pushed:
                pushed.add(seq)
                self._push(seq, step + 1)
        self.meter.sample(1, steady)
        return True

    def _full_step(self, step: int) -> None:
        """Every running sequence through `Scheduler.schedule`: bring them all up to date first."""
        for seq in self.scheduler.running:
            self._materialize(seq, step)
            self._anchor[seq] = step + 1  # this step's tokens are applied by the step itself
        self.step()
        self._due.clear()
        for seq in self.scheduler.running:
            self._push(seq, step + 1)

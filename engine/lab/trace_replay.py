"""One trace through the real Scheduler and BlockManager (the lab's fast path, no model), at one
pool capacity under one eviction policy.

- Arrivals: a request submitted at `timestamp` ms joins after engine step `timestamp / step_ms`
  (`step_ms`: the wall time of one engine step, each step computing up to
  `max_num_batched_tokens` tokens); or, `one_at_a_time`, each request once the one before it
  finished (a plain cache simulation, as the Mooncake paper's).
- Content: a sequence's full block is keyed by the trace's hash id of the 512-token block it lies
  in and its place there (`_Content`, through `Sequence.content`), so the prefix cache hashes and
  compares two or three ints a block, never 512 tokens. The prompt's token ids (each block's id
  repeated) are built when a request arrives, never for the whole file; outputs are
  `output_length` tokens of one value (`OUTPUT`), produced as the sequence decodes.
- Memory: requests not yet arrived stay lines of the file (`read_trace` streams them); a finished
  sequence leaves every table of the lab.
- Misses: each admission's missed tokens by reason (`TraceMeter`): `partial_block` (the prompt's
  last block, never looked up), `recomputed` (a re-admission after a recompute preemption), and
  per missed full block: `evicted` (its content had been cached before), `in_flight` (not cached
  yet, but a running sequence admitted earlier is computing it: a concurrent prefill), else `cold`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections import Counter

from kvscope_contract import protocol as p
from kvscope_contract.lab import LabConfig, LabRow
from engine.core.eviction import NEVER, EvictionPolicy
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import SamplingParams, Sequence
from engine.lab.meter import Meter
from engine.lab.sim import Lab
from engine.lab.trace import MAX_HASH_ID, TRACE_BLOCK, TraceIndex, TraceRequest, read_trace
from engine.lab.workload import Workload

# the token every output is (the trace has none): the largest token id the protocol carries (uint32),
# above every hash id (read_trace refuses ids that high)
OUTPUT = MAX_HASH_ID + 1
PROMPT_KEY = -2   # a full prompt block's content: (PROMPT_KEY, hash id, place in its 512-token block)
TAIL_KEY = -3     # a block holding output tokens: (TAIL_KEY, the hash id of its prompt part or -1, prompt tokens in it)


class _Content:
    """A trace request's block contents by its hash ids (Sequence.content). Keys are tuples no
    token slice can equal (their first element is negative, and output tokens are OUTPUT)."""
    __slots__ = ("ids", "length")

    def __init__(self, ids: list[int], length: int):
        self.ids, self.length = ids, length

    def __call__(self, i: int, bs: int) -> tuple[int, int, int]:
        start, n = i * bs, self.length
        if start + bs <= n:
            return PROMPT_KEY, self.ids[start // TRACE_BLOCK], (start % TRACE_BLOCK) // bs
        if start < n:
            return TAIL_KEY, self.ids[start // TRACE_BLOCK], n - start
        return TAIL_KEY, -1, 0


class _Outputs:
    """`n` output tokens, all OUTPUT, without a list of them (the lab slices and indexes it)."""
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [OUTPUT] * len(range(*k.indices(self.n)))
        if not -self.n <= k < self.n:
            raise IndexError(k)
        return OUTPUT


@dataclass
class _Arrival:
    index: int         # line number less one: the request id
    arrival: int       # the engine step it joins after
    request: TraceRequest


class _Arrivals:
    """The trace's requests as the lab's pending queue, read one line ahead.

    A request that has arrived while more than `hold` sequences already wait stays a line here
    (its `arrival` reads as never) until the queue is shorter: admission is first come first
    served and takes at most `max_num_seqs` sequences a step, so with `hold` at least that it is
    admitted at the same step either way, and memory holds `hold` prompts' tokens, not every
    request that waits (a small pool under the whole trace)."""

    def __init__(self, lab: TraceLab, hold: int):
        self.lines = enumerate(read_trace(lab.index.path, lab.limit))
        self.t0, self.step_ms, self.one = lab.index.first_timestamp, lab.step_ms, lab.one_at_a_time
        self.waiting, self.hold = lab.scheduler.waiting, hold
        self.head: _Arrival | None = None
        self._advance()

    def _advance(self) -> None:
        nxt = next(self.lines, None)
        if nxt is None:
            self.head = None
            return
        i, r = nxt
        # one at a time: an arrival never due, so a request joins only when the engine is idle
        step = math.inf if self.one else int((r.timestamp - self.t0) // self.step_ms)
        self.head = _Arrival(i, step, r)

    @property
    def arrival(self) -> float:
        return math.inf if len(self.waiting) > self.hold else self.head.arrival

    def __bool__(self) -> bool:
        return self.head is not None

    def __getitem__(self, k: int) -> _Arrivals:
        assert k == 0 and self.head is not None
        return self  # its `arrival` is the head's, or never while the queue is long

    def popleft(self) -> _Arrival:
        head = self.head
        self._advance()
        return head


class TraceFuture:
    """OPT's oracle: when a cached block's content is next looked up, in request indices. Requests
    are admitted in trace order (the scheduler's FIFO), so the future is every request from the
    one after the last admitted on."""

    def __init__(self, index: TraceIndex):
        self.index = index
        self.per = TRACE_BLOCK // index.block_size
        self.clock = 0  # the index of the next request to be admitted for the first time

    def now(self) -> float:
        return self.clock

    def next_use(self, cache: PrefixCache, block: int) -> tuple[float, int]:
        key = cache.tokens[block]
        if key is None or key[0] != PROMPT_KEY:
            return NEVER, 0  # a block holding output tokens: no trace prompt holds it
        when, depth = self.index.next_use(key[1], self.clock)
        return (NEVER if when is None else when), depth * self.per + key[2]


class TraceMeter(Meter):
    """The lab's meter plus what a trace sweep reports: missed tokens by reason, evictions, and
    OPT's clock. Draws no peak grid (a copy of a million-block pool at each new peak)."""

    def __init__(self, keep: bool = False):
        super().__init__(keep)
        self.missed: Counter = Counter()
        self.evictions = 0
        self.ever_cached: set[int] = set()      # chain hashes the pool has cached
        self.computing: Counter = Counter()     # chain hashes running sequences will compute
        self.computes: dict[str, list[int]] = {}  # seq -> its hashes in `computing`
        self.future: TraceFuture | None = None

    def _capture(self) -> None:
        pass

    def emit(self, ev: p.Event) -> None:
        super().emit(ev)
        kind = type(ev)
        if kind is p.StatusChange:
            self._admitted(ev.seq_id)
        elif kind is p.Cached:
            self.ever_cached.add(self.core.block_manager.cache.hashes[ev.block_id])
        elif kind is p.Evict:
            self.evictions += 1
        elif kind is p.Finish or kind is p.Preempt:
            for h in self.computes.pop(ev.seq_id, ()):
                self.computing[h] -= 1

    def _admitted(self, seq_id: str) -> None:
        """Split the admission's missed tokens by reason (after Meter counted its lookup)."""
        seq: Sequence = self.core.seqs[seq_id]
        bm, bs = self.core.block_manager, self.bs
        n, hit = len(seq), seq.num_computed_tokens  # the host tier's loads included: no miss of any reason
        if seq_id in self.recomputed:
            self.missed["recomputed"] += n - hit
            return
        if self.future is not None:
            self.future.clock = max(self.future.clock, int(seq.request_id) + 1)
        full = (n - 1) // bs
        self.missed["partial_block"] += n - max(full * bs, hit)
        ever, computing = self.ever_cached, self.computing
        for i in range(hit // bs, full):
            h = bm._block_hash(seq, i)
            self.missed["evicted" if h in ever else "in_flight" if computing[h] > 0 else "cold"] += bs
        mine = [bm._block_hash(seq, i) for i in range(hit // bs, seq.num_prompt_tokens // bs)]
        for h in mine:
            computing[h] += 1
        self.computes[seq_id] = mine


class TraceLab(Lab):
    """The lab fed by a trace: requests stream in at their arrival steps (or one at a time), each
    block's content its hash id, evicting by `policy`."""
    meter_class = TraceMeter

    def __init__(self, config: LabConfig, index: TraceIndex, policy: EvictionPolicy, *, step_ms: float,
                 one_at_a_time: bool = False, limit: int | None = None, keep_events: bool = False,
                 long_prefill_token_threshold: int = 0):
        super().__init__(config, Workload(index.path, []), keep_events)
        self.scheduler.long_prefill_token_threshold = long_prefill_token_threshold
        self.index, self.step_ms, self.one_at_a_time, self.limit = index, step_ms, one_at_a_time, limit
        self.future = TraceFuture(index)
        self.meter.future = self.future
        self.block_manager.pool.use(policy, self.future)
        self._content: dict[str, _Content] = {}

    def _add(self, a: _Arrival) -> None:
        r, rid = a.request, str(a.index)
        self._outputs[rid] = [_Outputs(r.output_length)]
        self._content[rid] = _Content(r.hash_ids, r.input_length)
        prompt: list[int] = []
        for h in r.hash_ids:
            prompt += [h] * TRACE_BLOCK
        del prompt[r.input_length:]
        try:
            self.add_tokens(prompt, SamplingParams(max_tokens=r.output_length), rid)
        except p.CommandError:
            self.rejected.append(rid)
            self._outputs.pop(rid, None)
            self._content.pop(rid, None)

    def _track(self, seq: Sequence, index: int) -> None:
        super()._track(seq, index)
        seq.content = self._content.pop(seq.request_id)

    def _finish(self, seq: Sequence, reason: p.FinishReason):
        out = super()._finish(seq, reason)
        # a finished sequence leaves every table, so the lab holds only live ones
        self._outputs.pop(seq.request_id, None)
        self.streams.pop(seq.seq_id, None)
        for table in (self._ends, self._anchor, self._version):
            table.pop(seq, None)
        return out

    def run(self, fast: bool = True, hold: int | None = None) -> LabRow:
        """Replay the trace to its end; `hold`: sequences that may wait before further arrivals
        stay lines of the file (default twice max_num_seqs, which changes no decision)."""
        hold = 2 * self.block_manager.config.max_num_seqs if hold is None else hold
        return super().run(fast, _Arrivals(self, hold))

"""The engine without a model: requests in, scheduled steps, forks, finishes, allocator events out.

`LLMEngine` (engine/model/engine.py) fills in the model: a forward per step and a sampler. The lab
(engine/lab/) fills in recorded outputs instead, so for the same tokens both make exactly the
same allocator decisions and events. Torch-free: the lab runs without it.
"""
from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from kvscope_contract import protocol as p
from engine.core.block_manager import BlockManager
from engine.core.capture import PoolCapture
from engine.core.events import EventLog
from engine.core.scheduler import Batch, Scheduler
from engine.core.sequence import SamplingParams, Sequence, SeqStatus


@dataclass
class Output:
    """A finished sequence."""
    seq_id: str
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: p.FinishReason


@dataclass
class StepResult:
    scheduled: bool        # False: nothing could run this step (a caller looping on it should not spin)
    finished: list[Output]  # sequences that ended in this step


def sample_id(request_id: str, index: int) -> str:
    """The sequence id of a request's sample `index` (0: the request's own)."""
    return f"{request_id}.{index}" if index else request_id


def sample_ids(request_id: str, n: int) -> list[str]:
    return [sample_id(request_id, i) for i in range(n)]


class EngineCore(ABC):
    """Subclasses give the tokens: `_execute` runs a batch (one payload per row that completes
    its tokens), `_sample` picks a sequence's next token from its row's payload, `_stops` says
    whether that token ends it, `_track` sets up a new sequence, `_detokenize` gives new text."""

    def __init__(self, pool: p.PoolConfig, max_num_batched_tokens: int = 1024, watermark: float = 0.01,
                 log: EventLog | None = None):
        self.log = log or EventLog()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = BlockManager(pool, self.log, watermark)
        self.scheduler = Scheduler(self.block_manager, self.log, max_num_batched_tokens)
        self.seqs: dict[str, Sequence] = {}  # live sequences, in creation order
        self.live_requests: Counter[str] = Counter()  # request id -> its live sequences
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ hooks
    def _execute(self, batch: Batch) -> list[Any] | None:
        """One payload per row of `batch` that completes (in row order); None when none does."""
        return None

    @abstractmethod
    def _sample(self, seq: Sequence, payload: Any) -> int:
        """The sequence's next token from its row's payload (every engine has its own source)."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        return False

    def _detokenize(self, seq: Sequence) -> str:
        return ""

    def _token_texts(self, ids: list[int]) -> list[str] | None:
        """The text of each prompt token, for `request_added` (None: not known)."""
        return None

    def _track(self, seq: Sequence, index: int) -> None:
        """A new sequence, sample `index` of its request."""
        self.seqs[seq.seq_id] = seq
        self.live_requests[seq.request_id] += 1

    # ------------------------------------------------------------------ observation
    @property
    def pool(self) -> p.PoolConfig:
        return self.block_manager.config

    def snapshot(self) -> p.Snapshot:
        return self.capture().state().snapshot()

    def capture(self) -> PoolCapture:
        """The pools now, copied cheaply; `.state()` turns it into the reducer's PoolState on any
        thread (the server encodes snapshots off the engine thread)."""
        return self.block_manager.capture(self.seqs.values())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def drain_events(self) -> list[p.Event]:
        """The allocator's events since the last call, in order."""
        return self.log.drain()

    # ------------------------------------------------------------------ requests
    def add_tokens(self, ids: list[int], params: SamplingParams, request_id: str | None = None) -> list[str]:
        """Queue a request of prompt token `ids`; returns its sequence ids. Raises CommandError
        when it cannot run."""
        if not ids:
            raise p.CommandError("invalid_argument", "the prompt has no tokens")
        taken = self._seq_ids_taken()
        if request_id is None:
            request_id = next(f"r{i}" for i in self._ids if f"r{i}" not in taken)
        elif self.live_requests[request_id]:
            raise p.CommandError("duplicate_id", f"request {request_id!r} is still running; "
                                 "pick another request_id or leave it out")
        if clash := next((x for x in sample_ids(request_id, params.n) if x in taken), None):
            raise p.CommandError("duplicate_id", f"request {request_id!r} would name a sequence {clash!r}, as a "
                                 f"running request's sample is named (samples are REQUEST.1, REQUEST.2, ...); "
                                 "pick another request_id or leave it out")
        bm = self.block_manager
        longest = len(ids) + params.max_tokens
        if not bm.can_ever_fit(longest, self.max_num_batched_tokens):
            groups = len(bm.groups)
            raise p.CommandError(
                "too_long", f"{len(ids)} prompt tokens + {params.max_tokens} new tokens need "
                f"{bm.peak_blocks(longest, self.max_num_batched_tokens)} blocks of {bm.block_size}"
                f"{f' across {groups} KV-cache groups' if groups > 1 else ''}, but the pool can give one "
                f"sequence at most {bm.max_blocks_per_seq}: shorten the "
                "prompt, lower max_tokens, or reset with a bigger pool")
        seq = Sequence(request_id, request_id, list(ids), params, block_tables=bm.new_tables(),
                       host_tables=bm.new_tables())
        self._track(seq, index=0)
        self.log.emit(p.RequestAdded(request_id=request_id, seq_id=request_id, prompt_tokens=len(ids),
                                     n=params.n, max_tokens=params.max_tokens, prompt_token_ids=list(ids),
                                     prompt_token_texts=self._token_texts(ids)))
        self.scheduler.add(seq)
        return sample_ids(request_id, params.n)

    def _seq_ids_taken(self) -> set[str]:
        """Every live sequence's id, and those its request's samples will take when they fork."""
        taken = set(self.seqs)
        for s in self.seqs.values():
            if s.seq_id == s.request_id and s.params.n > 1 and not s.num_output_tokens:
                taken.update(sample_ids(s.request_id, s.params.n))
        return taken

    def abort(self, request_id: str) -> list[Output]:
        """Finish every sequence of a request with reason `abort`."""
        return [self._finish(s, "abort") for s in list(self.seqs.values()) if s.request_id == request_id]

    def clear_prefix_cache(self) -> int:
        return self.block_manager.clear_prefix_cache()

    def _reset_pools(self, pool: p.PoolConfig) -> None:
        """Drop every request and rebuild both pools; a pool the block manager refuses (its
        CommandError says why) changes nothing."""
        self.block_manager.check(pool)
        self.seqs.clear()
        self.live_requests.clear()
        self.scheduler = Scheduler(self.block_manager, self.log, self.max_num_batched_tokens)
        self.block_manager.reset(pool)

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepResult:
        """Run one engine step."""
        if not self.scheduler.has_work():
            return StepResult(False, [])
        t0 = time.perf_counter()
        self.log.step += 1
        batch = self.scheduler.schedule()
        try:
            payloads = self._execute(batch)
        except Exception as e:  # a failed forward ends its sequences, never the engine
            for row in batch.rows:
                self._finish(row.seq, "error")
            raise RuntimeError(f"step {self.log.step} failed: {e}") from e
        if self.block_manager.offload is not None:  # the step's stores are copied: loadable from the next step on
            self.block_manager.offload.end_step()
        decode = sum(1 for r in batch.rows if r.num_tokens == 1 and r.seq.num_output_tokens)
        prefill = sum(r.num_tokens for r in batch.rows) - decode
        finished = self._postprocess(batch, payloads)
        sched = self.scheduler
        self.log.emit(p.StepDone(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped), prefill_tokens=prefill, decode_tokens=decode,
            duration_ms=round((time.perf_counter() - t0) * 1000, 3),
            free_blocks=self.block_manager.num_free_blocks,
            cached_blocks=self.block_manager.num_cached_blocks))
        return StepResult(bool(batch), finished)

    def _postprocess(self, batch: Batch, payloads: list[Any] | None) -> list[Output]:
        """The forward has run: tokens become computed, completed rows sample (forking the
        samples of a request at its first token), and finished sequences free their blocks."""
        finished: list[Output] = []
        completed = [r for r in batch.rows if r.completes]
        for row in batch.rows:
            row.seq.num_computed_tokens += row.num_tokens
            if not row.completes:  # a prefill chunk that does not end the prompt
                self.log.emit(p.Append(seq_id=row.seq.seq_id, num_tokens=row.seq.num_computed_tokens))
        for row, payload in zip(completed, payloads if payloads is not None else [None] * len(completed)):
            seq = row.seq
            family = [seq]
            if seq.params.n > 1 and seq.num_output_tokens == 0:
                family += [self._fork(seq, i) for i in range(1, seq.params.n)]
            for member in family:
                if reason := self._append_token(member, self._sample(member, payload)):
                    finished.append(self._finish(member, reason))
        return finished

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = Sequence(sample_id(parent.seq_id, index), parent.request_id, list(parent.token_ids),
                         replace(parent.params, n=1), parent.num_prompt_tokens,
                         num_computed_tokens=parent.num_computed_tokens,
                         host_tables=self.block_manager.new_tables())
        child.arrival = parent.arrival
        self._track(child, index)
        self.block_manager.fork(parent, child)
        self.scheduler.add_running(child)
        return child

    def _append_token(self, seq: Sequence, token: int) -> p.FinishReason | None:
        """Append a sampled token; returns why the sequence ends with it, if it does."""
        seq.token_ids.append(token)
        text = self._detokenize(seq)
        seq.text += text
        self.log.emit(p.Append(seq_id=seq.seq_id, num_tokens=seq.num_computed_tokens,
                               token_ids=[token], text=text))
        if not seq.params.ignore_eos and self._stops(seq, token):
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: p.FinishReason) -> Output:
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
        del self.seqs[seq.seq_id]
        if (left := self.live_requests[seq.request_id] - 1) > 0:
            self.live_requests[seq.request_id] = left
        else:
            self.live_requests.pop(seq.request_id, None)
        self.log.emit(p.Finish(seq_id=seq.seq_id, reason=reason))
        return Output(seq.seq_id, seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.output_ids,
                      seq.text, reason)

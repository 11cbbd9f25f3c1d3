"""The engine: requests in, one scheduled forward per step, tokens and allocator events out.

Single-threaded by design: the server runs it in its own thread and hands it commands
between steps.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import msgspec

from engine.contract import protocol as p
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.events import EventLog
from engine.model_loader import LoadedModel, apply_chat_template, load_model
from engine.model_runner import ModelRunner
from engine.sampler import make_generator, sample
from engine.scheduler import Batch, Scheduler
from engine.sequence import SamplingParams, Sequence, SeqStatus


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


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 progress=None):
        self.config = config = config or EngineConfig()
        self.loaded = loaded or load_model(config.model, device=config.device, dtype=config.dtype,
                                           **({"progress": progress} if progress else {}))
        self.tokenizer = self.loaded.tokenizer
        self.log = EventLog()
        self.runner = ModelRunner(self.loaded, config.pool, config.memory_fraction)
        config.pool = self._with_bytes(config.pool)
        self.block_manager = BlockManager(config.pool, self.log, config.watermark)
        self.scheduler = Scheduler(self.block_manager, self.log, config.max_num_batched_tokens)
        self.seqs: dict[str, Sequence] = {}  # live sequences, in creation order
        self._ids = itertools.count(1)

    def _with_bytes(self, pool: p.PoolConfig) -> p.PoolConfig:
        return msgspec.structs.replace(pool, bytes_per_block=self.runner.bytes_per_block(pool.block_size))

    # ------------------------------------------------------------------ observation
    @property
    def pool(self) -> p.PoolConfig:
        return self.block_manager.config

    def hello(self) -> p.Hello:
        return p.Hello(engine=self.runner.info(), config=self.pool)

    def snapshot(self) -> p.Snapshot:
        return self.block_manager.state(self.seqs.values()).snapshot()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def drain_events(self) -> list[p.Event]:
        """The allocator's events since the last call, in order."""
        return self.log.drain()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
                    *, messages: list[dict] | None = None, request_id: str | None = None) -> list[str]:
        """Queue a request; returns its sequence ids. Raises CommandError when it cannot run."""
        params = params or SamplingParams()
        if messages is not None:
            ids = apply_chat_template(self.tokenizer, messages)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt or [])
        if not ids:
            raise p.CommandError("invalid_argument", "the prompt has no tokens")
        if request_id is None:
            request_id = next(f"r{i}" for i in self._ids if f"r{i}" not in self.seqs)
        elif any(s.request_id == request_id for s in self.seqs.values()):
            raise p.CommandError("duplicate_id", f"request {request_id!r} is still running; "
                                 "pick another request_id or leave it out")
        bm = self.block_manager
        longest = len(ids) + params.max_tokens
        if not bm.can_ever_fit(longest):
            raise p.CommandError(
                "too_long", f"{len(ids)} prompt tokens + {params.max_tokens} new tokens need "
                f"{bm.num_blocks_for(longest)} blocks of {bm.block_size}, but the pool can give one "
                f"sequence at most {self.pool.num_device_blocks - bm.watermark_blocks}: shorten the "
                "prompt, lower max_tokens, or reset with a bigger pool")
        seq = Sequence(request_id, request_id, ids, params)
        self._track(seq, index=0)
        self.log.emit(p.RequestAdded(request_id=request_id, seq_id=request_id,
                                     prompt_tokens=len(ids), n=params.n, max_tokens=params.max_tokens))
        self.scheduler.add(seq)
        return [request_id] + [f"{request_id}.{i}" for i in range(1, params.n)]

    def _track(self, seq: Sequence, index: int) -> None:
        """Sample `index` of its request: its own detokenizer and seeded generator."""
        self.seqs[seq.seq_id] = seq
        seq.detokenizer = Detokenizer.after_prompt(seq.num_prompt_tokens)
        seq.generator = make_generator(seq.params, index)

    def abort(self, request_id: str) -> list[Output]:
        """Finish every sequence of a request with reason `abort`."""
        return [self._finish(s, "abort") for s in list(self.seqs.values()) if s.request_id == request_id]

    def clear_prefix_cache(self) -> int:
        return self.block_manager.clear_prefix_cache()

    def reset(self, pool: p.PoolConfig) -> None:
        """Drop every request and rebuild both pools; the model stays loaded."""
        self.runner.allocate(pool)  # raises, changing nothing, if it does not fit
        pool = self._with_bytes(pool)
        self.config.pool = pool
        self.seqs.clear()
        self.scheduler = Scheduler(self.block_manager, self.log, self.config.max_num_batched_tokens)
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
            logits = self.runner.execute(batch)
        except Exception as e:  # a failed forward ends its sequences, never the engine
            for row in batch.rows:
                self._finish(row.seq, "error")
            raise RuntimeError(f"step {self.log.step} failed: {e}") from e
        decode = sum(1 for r in batch.rows if r.num_tokens == 1 and r.seq.num_output_tokens)
        prefill = sum(r.num_tokens for r in batch.rows) - decode
        finished = self._postprocess(batch, logits)
        sched = self.scheduler
        self.log.emit(p.StepDone(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped), prefill_tokens=prefill, decode_tokens=decode,
            duration_ms=round((time.perf_counter() - t0) * 1000, 3),
            free_blocks=len(self.block_manager.free_ids),
            cached_blocks=self.block_manager.num_cached_blocks))
        return StepResult(bool(batch), finished)

    def _postprocess(self, batch: Batch, logits) -> list[Output]:
        finished: list[Output] = []
        completed = [r for r in batch.rows if r.completes]
        for row in batch.rows:
            row.seq.num_computed_tokens += row.num_tokens
            if not row.completes:  # a prefill chunk that does not end the prompt
                self.log.emit(p.Append(seq_id=row.seq.seq_id, num_tokens=row.seq.num_computed_tokens))
        for row, seq_logits in zip(completed, logits if logits is not None else []):
            seq = row.seq
            family = [seq]
            if seq.params.n > 1 and seq.num_output_tokens == 0:
                family += [self._fork(seq, i) for i in range(1, seq.params.n)]
            for member in family:
                token = sample(seq_logits, member.params, member.generator)
                if reason := self._append_token(member, token):
                    finished.append(self._finish(member, reason))
        return finished

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = Sequence(f"{parent.seq_id}.{index}", parent.request_id, list(parent.token_ids),
                         replace(parent.params, n=1), parent.num_prompt_tokens,
                         num_computed_tokens=parent.num_computed_tokens)
        child.arrival = parent.arrival
        self._track(child, index)
        self.block_manager.fork(parent, child)
        self.scheduler.add_running(child)
        return child

    def _append_token(self, seq: Sequence, token: int) -> p.FinishReason | None:
        """Append a sampled token; returns why the sequence ends with it, if it does."""
        seq.token_ids.append(token)
        text = seq.detokenizer.step(self.tokenizer, seq.token_ids)
        seq.text += text
        self.log.emit(p.Append(seq_id=seq.seq_id, num_tokens=seq.num_computed_tokens,
                               token_ids=[token], text=text))
        if not seq.params.ignore_eos and token in self.loaded.eos_token_ids:
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: p.FinishReason) -> Output:
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
        del self.seqs[seq.seq_id]
        self.log.emit(p.Finish(seq_id=seq.seq_id, reason=reason))
        return Output(seq.seq_id, seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.output_ids,
                      seq.text, reason)

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
                 ) -> list[list[Output]]:
        """Run `prompts` to completion; returns, per prompt, its samples in seq-id order.
        The allocator's events stay in `self.log` for the caller to drain."""
        rids = [self.add_request(prompt, params)[0] for prompt in prompts]
        done: dict[str, list[Output]] = {}
        while self.has_unfinished():
            for out in self.step().finished:
                done.setdefault(out.request_id, []).append(out)
        return [sorted(done.get(r, []), key=lambda o: (len(o.seq_id), o.seq_id)) for r in rids]

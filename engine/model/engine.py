"""The engine: requests in, one scheduled forward per step, tokens and allocator events out.

`EngineCore` (engine/core/engine_core.py) does the scheduling and bookkeeping; this adds the model: a
tokenizer, the paged model runner and a sampler. Single-threaded by design: the server runs it
in its own thread and hands it commands between steps.
"""
from __future__ import annotations

import msgspec

import kernels
from kvscope_contract import protocol as p
from kvscope_contract.kv_groups import group_layers
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore, Output, StepResult
from engine.core.detokenizer import Detokenizer
from engine.model.model_loader import LoadedModel, apply_chat_template, load_model
from engine.model.model_runner import ModelRunner
from engine.model.sampler import make_generator, sample
from engine.core.scheduler import Batch
from engine.core.sequence import SamplingParams, Sequence

__all__ = ["LLMEngine", "Output", "StepResult"]


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 progress=None):
        self.config = config = config or EngineConfig()
        self.loaded = loaded or load_model(config.model, device=config.device, dtype=config.dtype,
                                           **({"progress": progress} if progress else {}))
        self.tokenizer = self.loaded.tokenizer
        config.pool = self._with_model(config.pool)
        self.runner = ModelRunner(self.loaded, config.pool, config.memory_fraction)
        config.pool = self._with_bytes(config.pool)
        super().__init__(config.pool, config.max_num_batched_tokens, config.watermark)

    def _with_model(self, pool: p.PoolConfig) -> p.PoolConfig:
        """The pool's KV-cache groups are the model's (kvscope_contract.kv_groups): whatever a
        config or a reset names, a sliding-window model gets one group per window kind and size."""
        return msgspec.structs.replace(pool, kv_groups=group_layers(self.loaded.layer_kinds))

    def _with_bytes(self, pool: p.PoolConfig) -> p.PoolConfig:
        return msgspec.structs.replace(pool, bytes_per_block=self.runner.bytes_per_block(pool))

    def hello(self) -> p.Hello:
        return p.Hello(engine=self.runner.info(), config=self.pool)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
                    *, messages: list[dict] | None = None, request_id: str | None = None) -> list[str]:
        """Queue a request; returns its sequence ids. Raises CommandError when it cannot run."""
        if messages is not None:
            ids = self.tokenize_chat(messages)
        elif isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = list(prompt or [])
        return self.add_tokens(ids, params or SamplingParams(), request_id)

    def tokenize(self, prompt: str) -> list[int]:
        """A plain prompt's token ids (no chat template), with the special tokens the tokenizer adds
        to any text, as HF's tokenizer(text) and vLLM do: Gemma's <bos> (without it Gemma 3 270M
        continues "The capital of France is" with " France. The The The ..."); none for SmolLM2."""
        return self.tokenizer.encode(prompt)

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        """A chat's token ids, as `add_request(messages=...)` runs it (the chat template)."""
        return apply_chat_template(self.tokenizer, messages)

    def reset(self, pool: p.PoolConfig) -> None:
        """Drop every request and rebuild both pools; the model stays loaded."""
        pool = self._with_bytes(self._with_model(pool))
        self.runner.check_fits(pool)  # raises, changing nothing, if it does not fit
        self._reset_pools(pool)  # raises for groups the pool cannot serve (a window smaller than a block)
        self.runner.allocate(pool)
        self.config.pool = pool

    # ------------------------------------------------------------------ the model's part of a step
    def _track(self, seq: Sequence, index: int) -> None:
        """Sample `index` of its request: its own detokenizer and seeded generator."""
        super()._track(seq, index)
        seq.detokenizer = Detokenizer.after_prompt(seq.num_prompt_tokens)
        seq.generator = make_generator(seq.params, index)

    def _execute(self, batch: Batch):
        """One (logits, greedy token) per completing row: the argmax of every row in one call, as
        most rows sample greedily (kernels.argmax; batch 32 here: 0.9 ms row by row in torch)."""
        logits = self.runner.execute(batch)
        if logits is None:
            return None
        greedy = any(r.seq.params.temperature == 0 for r in batch.rows if r.completes)
        return list(zip(logits, kernels.argmax(logits).tolist() if greedy else [None] * len(logits)))

    def _sample(self, seq: Sequence, payload) -> int:
        logits, greedy = payload
        return greedy if seq.params.temperature == 0 else sample(logits, seq.params, seq.generator)

    def _stops(self, seq: Sequence, token: int) -> bool:
        return token in self.loaded.eos_token_ids

    def _detokenize(self, seq: Sequence) -> str:
        return seq.detokenizer.step(self.tokenizer, seq.token_ids)

    def _token_texts(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode(list(zip(ids)))  # one token each (2 µs a token)

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

"""A production-size pool under load without a model: the real engine core (scheduler, block
manager, prefix cache, forks, preemption, event log) and the real server, with made-up words for
tokens and a random next token for the forward pass. For the dashboard bench and the big-pool
tests, where a model's KV cache for a million blocks would not fit. No torch.

    python -m engine.synthetic --num-device-blocks 131072 --live 512 --fill 0.8 --step-delay-ms 50

Requests keep arriving so that `--live` are in the engine at once: prompts start with one of a
few shared system prompts (prefix hits), some ask for parallel samples (forks, copy-on-write).
Before serving, it runs unpaced until `--fill` of the device pool is used or cached, then
`--warm-steps` steps at the serving batch size.

`--engines N` serves N such pools from this one process, each its own engine core, engine
thread and server, on ports P..P+N-1 (`--port P`; 0: each a free port), each printing its own
ready line: a fleet for bench/fleet_scale.py without a process per engine.
"""
from __future__ import annotations

import argparse
import logging
import random
import sys
import time
import zlib
from types import SimpleNamespace

import msgspec

from engine.serve.cli import add_listen_args, refuse_open_bind, serve_all_until_signal, setup_logging
from engine.config import EngineConfig
from kvscope_contract import protocol as p
from kvscope_contract.kv_groups import bytes_per_block, gemma3_groups
from kvscope_contract.ready import ready_line, ws_url
from engine.core.engine_core import EngineCore, StepResult
from engine.serve.hub import Hub
from engine.core.sequence import SamplingParams, Sequence
from engine.serve.server import EngineLoop

log = logging.getLogger("kvscope")
# the vocabulary: token i is the word WORDS[i] (a prompt of these words is tokens a test can name)
SYLLABLES = ["ka", "lo", "mi", "re", "su", "ta", "no", "vi", "de", "po", "ra", "ne", "ku", "si", "ba", "to"]
VOCAB = 4096
WORDS = [f" {SYLLABLES[i % 16]}{SYLLABLES[(i // 16) % 16]}{SYLLABLES[i // 256]}" for i in range(VOCAB)]
INDEX = {w.strip(): i for i, w in enumerate(WORDS)}
INFO = p.EngineInfo(model="synthetic load (random tokens)", device="cpu", dtype="bfloat16",
                    num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2's shapes, for bytes per block
HYBRID_INFO = p.EngineInfo(model="synthetic hybrid load (random tokens)", device="cpu", dtype="bfloat16",
                           num_layers=18, num_kv_heads=1, head_dim=256)  # Gemma 3 270M's shapes


class SyntheticEngine(EngineCore):
    """The engine core with random tokens, keeping `live` requests in flight; the server's
    engine API (`add_request`, `reset`, `hello`, `loaded`)."""

    def __init__(self, config: EngineConfig, live: int, prompt_tokens: int = 1024, max_tokens: int = 512,
                 parallel_every: int = 10, seed: int = 0):
        self.info = HYBRID_INFO if config.pool.kv_groups else INFO
        config.pool = msgspec.structs.replace(config.pool, bytes_per_block=self._bytes(config.pool))
        super().__init__(config.pool, config.max_num_batched_tokens, config.watermark)
        self.config, self.loaded = config, SimpleNamespace(name=INFO.model)
        self.live, self.prompt_tokens, self.max_tokens = live, prompt_tokens, max_tokens
        self.parallel_every, self.rng = parallel_every, random.Random(seed)
        self.prefixes = [self.rng.choices(range(VOCAB), k=self.rng.randint(64, 512)) for _ in range(6)]
        self.added = 0

    def _bytes(self, pool: p.PoolConfig) -> int:
        i = self.info
        return bytes_per_block(pool.block_size, pool.kv_groups, i.num_layers, i.num_kv_heads, i.head_dim, 2)  # bf16

    def hello(self) -> p.Hello:
        return p.Hello(engine=self.info, config=self.pool, server="kvscope synthetic load")

    # ------------------------------------------------------------------ the engine API of the server
    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
                    *, messages: list[dict] | None = None, request_id: str | None = None) -> list[str]:
        ids = self.tokenize_chat(messages) if messages else self.tokenize(prompt) if isinstance(prompt, str) \
            else list(prompt or [])
        return self.add_tokens(ids, params or SamplingParams(), request_id)

    @classmethod
    def tokenize_chat(cls, messages: list[dict]) -> list[int]:
        """A chat as this engine runs it: its messages' text, one a line (no chat template)."""
        return cls.tokenize("\n".join(m["content"] for m in messages))

    @staticmethod
    def tokenize(text: str) -> list[int]:
        """A word per token; a word outside the vocabulary by its CRC (the same in every process)."""
        return [INDEX.get(w, zlib.crc32(w.encode()) % VOCAB) for w in text.split()]

    def reset(self, pool: p.PoolConfig) -> None:
        self.config.pool = msgspec.structs.replace(pool, bytes_per_block=self._bytes(pool))
        self._reset_pools(self.config.pool)

    # ------------------------------------------------------------------ the model's part, made up
    def _token_texts(self, ids: list[int]) -> list[str]:
        return [WORDS[i] for i in ids]

    def _sample(self, seq: Sequence, payload) -> int:
        return self.rng.randrange(VOCAB)

    def _detokenize(self, seq: Sequence) -> str:
        return WORDS[seq.token_ids[-1]]

    # ------------------------------------------------------------------ the load
    def top_up(self) -> None:
        bs, cap = self.pool.block_size, self.pool.num_device_blocks * self.pool.block_size // 4
        while len(self.seqs) < self.live:
            self.added += 1
            tail = self.rng.choices(range(VOCAB), k=self.rng.randint(8, 2 * self.prompt_tokens))
            prompt = (self.rng.choice(self.prefixes) + tail)[:max(bs, cap - self.max_tokens)]
            n = 4 if self.parallel_every and self.added % self.parallel_every == 0 else 1
            params = SamplingParams(max_tokens=self.rng.randint(1, self.max_tokens), n=n, ignore_eos=True)
            self.add_tokens(prompt, params, f"s{self.added}")

    def has_unfinished(self) -> bool:
        return self.live > 0 or super().has_unfinished()

    def step(self) -> StepResult:
        self.top_up()
        return super().step()

    def fill(self, fraction: float, max_seconds: float = 600) -> None:
        """Run unpaced, dropping the events, until `fraction` of the device pool is used or
        cached: one token per request and big prefill batches meanwhile, so requests finish
        fast and leave their blocks cached."""
        n, deadline = self.pool.num_device_blocks, time.monotonic() + max_seconds
        longest, budget = self.max_tokens, self.scheduler.max_num_batched_tokens
        self.max_tokens, self.scheduler.max_num_batched_tokens = 1, max(budget, 65536)
        try:
            while time.monotonic() < deadline and n - self.block_manager.num_free_blocks < fraction * n:
                self.step()
                self.drain_events()
        finally:
            self.max_tokens, self.scheduler.max_num_batched_tokens = longest, budget

    def warm(self, steps: int = 200) -> None:
        """Run `steps` steps at the serving batch size, dropping the events: the running
        requests then hold their blocks, as in a pool that has served for a while."""
        for _ in range(steps):
            self.step()
            self.drain_events()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_listen_args(ap)
    ap.add_argument("--num-device-blocks", type=int, default=131072)
    ap.add_argument("--num-host-blocks", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="sequences that run at once")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--live", type=int, default=512, help="requests kept in the engine")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="mean prompt length after the shared prefix")
    ap.add_argument("--max-tokens", type=int, default=512, help="longest generation")
    ap.add_argument("--fill", type=float, default=0.8, help="used or cached share of the pool before serving")
    ap.add_argument("--warm-steps", type=int, default=200, help="steps run after the fill, before serving")
    ap.add_argument("--step-delay-ms", type=float, default=50.0)
    ap.add_argument("--engines", type=int, default=1, help="pools served from this process, each on its own port")
    ap.add_argument("--window", type=int, default=None, metavar="W",
                    help="a hybrid pool of Gemma 3 270M's shape: 5 sliding-window groups of W tokens, 1 full")
    args = ap.parse_args(argv)
    setup_logging()
    if refuse_open_bind(args.host, args.token):
        return 2
    if args.engines < 1:
        log.error("--engines must be at least 1, got %d", args.engines)
        return 2
    pool = p.PoolConfig(block_size=args.block_size, num_device_blocks=args.num_device_blocks,
                        num_host_blocks=args.num_host_blocks, max_num_seqs=args.max_num_seqs,
                        kv_groups=gemma3_groups(args.window) if args.window else [])
    hubs = []
    for i in range(args.engines):
        engine = SyntheticEngine(EngineConfig(model="synthetic", pool=pool,
                                              max_num_batched_tokens=args.max_num_batched_tokens),
                                 args.live, args.prompt_tokens, args.max_tokens, seed=i)
        t0 = time.monotonic()
        engine.fill(args.fill)
        engine.warm(args.warm_steps)
        free, cached, used, shared, _ = engine.capture().state().counts()
        log.info("engine %d filled in %.1f s: %d used (%d shared), %d cached, %d free, %d sequences",
                 i, time.monotonic() - t0, used, shared, cached, free, len(engine.seqs))
        hub = Hub(EngineLoop(engine, args.step_delay_ms), token=args.token, view_token=args.view_token,
                  tokenize=engine.tokenize, tokenize_chat=engine.tokenize_chat)
        hubs.append((hub, args.port + i if args.port else 0))
    serve_all_until_signal(hubs, args.host, lambda i, port: log.info(
        ready_line(ws_url(args.host, port), f"serving a synthetic load on {args.num_device_blocks} device blocks"
                   + (f" (engine {i + 1} of {args.engines})" if args.engines > 1 else ""))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

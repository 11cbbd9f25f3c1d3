"""A load from the host tier against recomputing the same prefix (docs/offload.md): SmolLM2 on this
CPU, the admission step of a prompt whose full blocks the device no longer holds, with a host tier
(its blocks loaded back through the engine's copy kernel) and without (recomputed), per prompt
length; and what the stores cost decode throughput when nothing is loaded (--decode: the same
batch decoded with and without a host tier, every block completed stored). Sides interleaved round
by round (bench/rounds.py), medians (min..max).

    python -m bench.offload [--lengths 16,64,256,1024] [--rounds 3] [--model smollm2]
    python -m bench.offload --decode [--seqs 8] [--tokens 128] [--rounds 3]
"""
import engine  # noqa: F401  (before any torch import: the engine's OpenMP wait policy)

import argparse
import random
import statistics
import time

from bench.rounds import interleave, spread
from engine.config import EngineConfig
from engine.core.sequence import SamplingParams
from engine.model.engine import LLMEngine
from engine.model.model_loader import load_model
from kvscope_contract import protocol as p

BLOCK = 16


def admission_ms(eng: LLMEngine, ids: list[int]) -> float:
    """The step that admits `ids` again once the device's prefix cache is cleared: its K/V loaded from
    the host tier when the engine has one, else recomputed (one new token either way)."""
    eng.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))  # computed, and stored where a tier is
    eng.clear_prefix_cache()  # the device forgets; the host tier keeps its copies
    eng.add_tokens(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    eng.step()
    ms = (time.perf_counter() - t0) * 1000
    while eng.has_unfinished():
        eng.step()
    loads = [e for e in eng.drain_events() if isinstance(e, p.OffloadLoad)]
    assert bool(loads) == bool(eng.pool.num_offload_blocks), "a host tier loads, no tier recomputes"
    return ms


def decode_tokens_per_s(eng: LLMEngine, seqs: int, tokens: int, rng: random.Random) -> float:
    """Decode throughput of `seqs` fresh prompts of 32 tokens generating `tokens` each (the prefill
    step left out): nothing is loaded, so a host tier only stores the blocks as they complete."""
    for _ in range(seqs):
        eng.add_tokens([rng.randrange(100, 40000) for _ in range(32)],
                       SamplingParams(max_tokens=tokens, ignore_eos=True))
    eng.step()  # the prefills
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step()
        n += 1
    elapsed = time.perf_counter() - t0
    stored = sum(isinstance(e, p.OffloadStore) for e in eng.drain_events())
    assert bool(stored) == bool(eng.pool.num_offload_blocks)
    return seqs * (tokens - 1) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="16,64,256,1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--decode", action="store_true", help="decode throughput with and without a host tier")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    loaded = load_model(args.model)
    if args.decode:
        return decode(loaded, args)
    lengths = [int(x) for x in args.lengths.split(",")]
    blocks = max(lengths) // BLOCK + 8
    engines = {name: LLMEngine(EngineConfig(model=args.model, max_num_batched_tokens=4096, pool=p.PoolConfig(
        block_size=BLOCK, num_device_blocks=2 * blocks, num_host_blocks=0, num_offload_blocks=tier,
        preemption_mode="recompute")), loaded) for name, tier in (("load", 4 * blocks), ("recompute", 0))}
    rng = random.Random(0)
    print(f"{loaded.name} on {engines['load'].runner.info().kernels or 'cuda'}, blocks of {BLOCK}")
    print(f"{'tokens':>7} {'load ms':>20} {'recompute ms':>20} {'recompute / load':>17}")
    for n in lengths:
        def side(name: str, n: int = n) -> float:  # a fresh prompt each run: nothing left from the run before
            return admission_ms(engines[name], [rng.randrange(100, 40000) for _ in range(n + 1)])  # +1: computed

        runs = interleave({"load": lambda: side("load"), "recompute": lambda: side("recompute")}, args.rounds)
        ratio = statistics.median(r / l for l, r in zip(runs["load"], runs["recompute"]))
        print(f"{n:>7} {spread(runs['load']):>20} {spread(runs['recompute']):>20} {ratio:>16.2f}x")


def decode(loaded, args) -> None:
    blocks = args.seqs * (-(-(32 + args.tokens) // BLOCK)) + 8
    engines = {name: LLMEngine(EngineConfig(model=args.model, pool=p.PoolConfig(
        block_size=BLOCK, num_device_blocks=blocks, num_host_blocks=0, num_offload_blocks=tier, max_num_seqs=args.seqs,
        preemption_mode="recompute")), loaded) for name, tier in (("host tier", 4 * blocks), ("device only", 0))}
    rng = random.Random(0)
    runs = interleave({name: (lambda e=e: decode_tokens_per_s(e, args.seqs, args.tokens, rng))
                       for name, e in engines.items()}, args.rounds)
    print(f"{loaded.name}, {args.seqs} sequences x {args.tokens} tokens, blocks of {BLOCK}: decode tokens/s")
    for name, xs in runs.items():
        print(f"  {name:>12}: {spread(xs)}")
    ratio = statistics.median(t / d for t, d in zip(runs["host tier"], runs["device only"]))
    print(f"  host tier / device only: {ratio:.3f}")


if __name__ == "__main__":
    main()

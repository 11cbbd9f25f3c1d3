"""Generate from the command line on the paged engine, and count the allocator's events.

    python -m engine.model.generate "The capital of France is" --n 4 --max-tokens 32 --temperature 0.8 --seed 1
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from engine.config import add_engine_args, config_from_args
from kvscope_contract.kinds import BLOCK_KINDS, kind_of
from engine.model.engine import LLMEngine
from kvscope_contract.protocol import CommandError
from engine.core.sequence import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SamplingParams()
    ap.add_argument("prompt")
    ap.add_argument("--n", type=int, default=d.n, help="parallel samples sharing the prompt's blocks")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--top-p", type=float, default=d.top_p)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    engine = LLMEngine(config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, n=args.n, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        if args.chat:
            engine.add_request(messages=[{"role": "user", "content": args.prompt}], params=params)
        else:
            engine.add_request(args.prompt, params)
    except CommandError as e:
        print(f"error ({e.code}): {e.message}", file=sys.stderr)
        return 2
    finished = []
    while engine.has_unfinished():
        finished += engine.step().finished
    for out in sorted(finished, key=lambda o: (len(o.seq_id), o.seq_id)):
        header = f"[{out.seq_id}] " if args.n > 1 else ""
        print(f"{header}{out.text}  ({len(out.token_ids)} tokens, {out.finish_reason})")
    counts = Counter(kind_of(ev) for ev in engine.drain_events())
    print("block events: " + ", ".join(f"{kind} {counts[kind]}" for kind in BLOCK_KINDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())

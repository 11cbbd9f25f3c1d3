"""vLLM's throughput with the KVScope plugin observing its pool, against vLLM without it.

The job of bench/throughput.py (32 prompts of 16..256 tokens, 128 new tokens each, EOS ignored,
greedy) through two vLLM engines in this process, one started with KVSCOPE_PORT set (the plugin
observes, and a WebSocket client reads every event) and one without; runs alternate between
them (on, off, off, on, ...), each after clearing the prefix cache. It prints the medians of
each side and the median of the per-round ratios (on / off, the two runs of one round being
closest in time). (CPU seconds per process are no better a measure here: vLLM's engine core
waits on its worker by polling, so its CPU time follows the machine's load, not the plugin.)
Run it with vLLM's virtualenv (`make bench-vllm`):

    .venv-vllm/bin/python -m bench.vllm_overhead [--rounds 4] [--model DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

from bench.prompts import make_prompts
from kvscope_contract.ready import free_port
from integrations.vllm.serve import BUNDLED



def make_llm(model: str, observed_port: int | None):
    from vllm import LLM

    if observed_port is None:
        os.environ.pop("KVSCOPE_PORT", None)
    else:
        os.environ["KVSCOPE_PORT"] = str(observed_port)
    return LLM(model=model, enforce_eager=True, max_model_len=2048, block_size=32,
               enable_prefix_caching=True, seed=0)


class Reader:
    """A KVScope client that reads (and decodes) every message, as a dashboard would."""

    def __init__(self, url: str):
        from app.link.wire import WireClient

        self.wire = WireClient(url, mirror=False)
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def events(self) -> int:
        return sum(self.wire.kinds.values())

    def _run(self) -> None:
        try:
            for _ in self.wire:
                pass
        except Exception:
            pass


def run(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams, TokensPrompt

    llm.reset_prefix_cache()  # every run prefills every prompt
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--rounds", type=int, default=4, help="timed runs per side")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(args.model), args.requests)
    port = free_port()
    engines = {"on": make_llm(args.model, port), "off": make_llm(args.model, None)}
    reader = Reader(f"ws://127.0.0.1:{port}/")
    for llm in engines.values():
        run(llm, prompts[:4], 8)  # warm up
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.rounds):
        for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
            elapsed, tokens = run(engines[side], prompts, args.new_tokens)
            rates[side].append(tokens / elapsed)
            print(f"round {i + 1} {side:3s}: {tokens / elapsed:6.1f} tok/s ({tokens} tokens in {elapsed:.1f} s)",
                  flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in rates.items():
        print(f"plugin {k:3s}: median {med[k]:6.1f} tok/s, spread {min(v):.1f}..{max(v):.1f} over {len(v)} runs")
    paired = statistics.median(a / b for a, b in zip(rates["on"], rates["off"]))
    print(f"overhead of the plugin: {100 * (med['off'] - med['on']) / med['off']:+.1f}% of vLLM's throughput "
          f"(medians); {100 * (1 - paired):+.1f}% (median of the rounds' on/off ratios); "
          f"{reader.events} events read by one client")

if __name__ == "__main__":
    main()

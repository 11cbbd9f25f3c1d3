"""The throughput job's prompts, torch-free so that vLLM's virtualenv can build them too
(bench/throughput.py, bench/vllm_overhead.py): 32 prompts of 16..256 tokens, no shared prefixes."""
from __future__ import annotations

TEXT = ("PagedAttention stores the keys and values of each sequence in fixed-size blocks that "
        "can live anywhere in one big pool, the way an operating system maps virtual pages to "
        "physical frames. A block table maps each logical block of a sequence to a physical "
        "block. Blocks are allocated on demand as tokens arrive, shared between sequences with "
        "the same prefix, copied on write when a shared block is modified, and swapped to host "
        "memory when the pool runs out. ")


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    base = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    lengths = [round(16 + i * (256 - 16) / max(1, count - 1)) for i in range(count)]
    return [base[7 * i: 7 * i + n] for i, n in enumerate(lengths)]  # distinct starts: no sharing

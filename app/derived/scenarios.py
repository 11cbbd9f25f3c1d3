"""Scenario presets: each is a few commands that make one mechanism of the allocator appear
within seconds, sized from the pool's current configuration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvscope_contract import protocol as p

SYSTEM_PROMPT = (
    "You are KVScope's tutor, a patient assistant who explains how large language models are "
    "served. Answer in two or three plain sentences, without lists or code. When a question is "
    "about memory, mention the key-value cache: every token of a conversation stores one key "
    "and one value vector per layer, and a paged cache keeps them in fixed-size blocks that "
    "are allocated on demand, shared between requests with the same prefix, and copied only "
    "when a shared block is written.")
QUESTIONS = ("What is a block table?", "Why does batching help throughput?",
             "What is prefix caching?", "Why can memory run out while generating?")
FILLER = ("the pool holds fixed size blocks of keys and values and each sequence maps its "
          "logical blocks through a block table to physical blocks anywhere in the pool while "
          "new tokens arrive one step at a time").split()
TOKENS_PER_WORD = 1.03  # SmolLM2's tokenizer on plain English; the engine reports the exact count


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    watch: Callable[[p.PoolConfig], str]  # what to look at with this pool, shown beside the button
    build: Callable[[p.PoolConfig, int], list[p.Command]]


def _words(n_tokens: int, lead: str) -> str:
    n = max(1, int(n_tokens / TOKENS_PER_WORD))
    return lead + " " + " ".join(FILLER[i % len(FILLER)] for i in range(n))


def shared_prefix(cfg: p.PoolConfig, run: int) -> list[p.Command]:
    return [p.Submit(messages=[p.ChatMessage("system", SYSTEM_PROMPT), p.ChatMessage("user", q)],
                     request_id=f"sys{run}-{i}", max_tokens=48)
            for i, q in enumerate(QUESTIONS, 1)]


def parallel_sampling(cfg: p.PoolConfig, run: int) -> list[p.Command]:
    return [p.Submit(messages=[p.ChatMessage("user", "Describe a library at night in three sentences.")],
                     request_id=f"par{run}", n=4, temperature=0.8, seed=run, max_tokens=64)]


OVERLOAD_MAX_TOKENS = 4096  # a pool that holds more than this is reset smaller first


def overload(cfg: p.PoolConfig, run: int) -> list[p.Command]:
    """Prompts that fill ~95% of the pool, then long generations: the pool runs out within
    a few dozen steps, and the newest sequences are preempted (swapped or recomputed)."""
    cmds: list[p.Command] = []
    if cfg.num_device_blocks * cfg.block_size > OVERLOAD_MAX_TOKENS:
        blocks = max(16, OVERLOAD_MAX_TOKENS // cfg.block_size)
        cmds.append(p.ResetCmd(config=p.ResetConfig(num_device_blocks=blocks)))
        cfg = p.PoolConfig(block_size=cfg.block_size, num_device_blocks=blocks,
                           max_num_seqs=cfg.max_num_seqs)
    capacity = cfg.num_device_blocks * cfg.block_size
    n = max(2, min(cfg.max_num_seqs, 8))
    prompt, new = int(0.95 * capacity / n), max(8, int(0.3 * capacity / n))
    return cmds + [p.Submit(prompt=_words(prompt, f"Request {i} of run {run}:"), max_tokens=new,
                            ignore_eos=True, request_id=f"load{run}-{i}") for i in range(1, n + 1)]


# Shared by the mixed requests, as a chat service's system prompt is: longer than one block of
# 32 tokens (vLLM's CPU block size), so their first blocks hit the prefix cache there too.
MIXED_SYSTEM = ("You are a concise assistant in a demo of how a paged KV cache serves many requests at "
                "once. Answer short questions in a word or two; when asked for a story, tell a long one "
                "with many small scenes.")


def long_and_short(cfg: p.PoolConfig, run: int) -> list[p.Command]:
    """Two long generations among short answers, all allowed 256 tokens: a contiguous
    reservation holds 256 slots for each; paging holds what each really uses."""
    chat = lambda q: [p.ChatMessage("system", MIXED_SYSTEM), p.ChatMessage("user", q)]
    long = [p.Submit(messages=chat(f"Tell a long story about a {w} who learns to sail."),
                     request_id=f"mix{run}-long{i}", max_tokens=256, ignore_eos=True)
            for i, w in enumerate(("cat", "robot"), 1)]
    short = [p.Submit(messages=chat(q), request_id=f"mix{run}-short{i}", max_tokens=256)
             for i, q in enumerate(("What is 2 + 2? Answer with a number.", "Say hello.",
                                    "Name a colour.", "Is water wet? Yes or no.",
                                    "Capital of France? One word.", "Spell 'cache'."), 1)]
    return long + short


def _shared_watch(cfg: p.PoolConfig) -> str:
    if not cfg.enable_prefix_caching:
        return ("the prefix cache is off in this pool, so every request computes the system prompt "
                "itself: no hits, no sharing (turn caching on under Reset pool to see them)")
    return (f"prefix hits: the first blocks of every request point at the same physical blocks "
            f"(×{len(QUESTIONS)})")


def _overload_watch(cfg: p.PoolConfig) -> str:
    if cfg.preemption_mode == "swap" and cfg.num_host_blocks:
        how = "swapped out to the host pool and back in (recomputed when the host pool is full)"
    else:
        why = "recompute mode" if cfg.preemption_mode == "recompute" else "no host pool"
        how = f"their blocks freed and their tokens computed again when they return ({why})"
    return (f"long prompts fill the pool (a few seconds of prefill on a CPU), then the newest sequences "
            f"are preempted: {how} (a pool over {OVERLOAD_MAX_TOKENS:,} tokens is reset smaller first)")


SCENARIOS = (
    Scenario("shared", "Shared system prompt", _shared_watch, shared_prefix),
    Scenario("parallel", "Parallel sampling (n=4)", lambda cfg: "fork shares the prompt's blocks, then "
             "copy-on-write on the first write into the shared last block", parallel_sampling),
    Scenario("overload", "Overload the pool", _overload_watch, overload),
    Scenario("mixed", "Long and short mixed", lambda cfg: "fragmentation: contiguous max-length "
             "reservation vs what paging holds", long_and_short),
)

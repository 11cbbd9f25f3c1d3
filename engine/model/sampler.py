"""Sampling: greedy, temperature and top-p, each sequence with its own seeded generator."""
from __future__ import annotations

import torch

from engine.core.sequence import SamplingParams


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """A generator per sequence (sample `index` of its request), so a seeded request gives the
    same tokens however the scheduler batches or preempts it."""
    if params.seed is None or params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed((params.seed * 1_000_003 + index) % (2**63))
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a row of logits [vocab]."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))

"""Sampling against the distribution it promises: top-p keeps the smallest set of most likely
tokens whose probability reaches p, renormalised; temperature 0 is the argmax."""
from __future__ import annotations

from collections import Counter

import torch

from engine.model.sampler import make_generator, sample
from engine.core.sequence import SamplingParams

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # by rank: token 1, 3, 2, 0
DRAWS = 4000


def draws(top_p: float, seed: int = 0) -> Counter:
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=seed)
    g = make_generator(params, 0)
    return Counter(sample(PROBS.log(), params, g) for _ in range(DRAWS))


def test_top_p_keeps_the_nucleus_in_proportion():
    got = draws(0.75)  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: tokens 1 and 3
    assert set(got) == {1, 3}
    assert abs(got[1] / DRAWS - 0.5 / 0.8) < 0.03  # renormalised over the nucleus: 0.625


def test_top_p_one_keeps_every_token_and_a_tiny_top_p_only_the_top():
    everything = draws(1.0)
    assert set(everything) == {0, 1, 2, 3} and abs(everything[0] / DRAWS - 0.05) < 0.015
    assert set(draws(1e-6)) == {1}


def test_a_seed_repeats_the_draws_and_temperature_zero_is_the_argmax():
    assert draws(0.9, seed=4) == draws(0.9, seed=4)
    assert sample(PROBS.log(), SamplingParams(temperature=0.0, top_p=0.1), None) == 1

"""bench/decode_step.py: both of its sides decode, the same tokens, and op by op leaves the runner
as it found it."""
from __future__ import annotations

import re

import pytest

from bench.decode_step import compare, op_by_op
from engine.model import decode_step
from kernels import cpu_build

ok, why = cpu_build.supported()
pytestmark = pytest.mark.skipif(not ok, reason=f"C++ CPU kernels cannot be built here: {why}")


def test_both_sides_decode_the_same_tokens_and_the_runner_is_left_as_found(monkeypatch):
    calls = {"one call": 0}
    takes = decode_step.takes
    monkeypatch.setattr(decode_step, "takes", lambda *a: bool(takes(*a)) and not calls.__setitem__(
        "one call", calls["one call"] + 1))
    before = decode_step.takes
    row = compare("tiny", "float32", rounds=1, read_gbs=10.0, huge_gbs=20.0)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "tiny, float32" and cells[-1] == "True", row
    shares = re.fullmatch(r"[\d.]+ GB/s, (\d+)% of the plain read \((\d+)% on 2 MB pages\)", cells[4])
    assert shares, row
    plain, huge = map(int, shares.groups())  # against reads of 10 and 20 GB/s: one share twice the other
    assert abs(plain - 2 * huge) <= 1, row
    assert calls["one call"] == 2 * 128  # the warm-up and the round's one-call side, 128 decode steps each
    assert decode_step.takes is before
    with op_by_op():
        assert decode_step.takes(None, []) is False
    assert decode_step.takes is before

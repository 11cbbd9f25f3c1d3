"""What each stop of a lesson on real traffic (app/lessons/trace_lesson.py) claims, checked against
its sweep's points and against the trace file itself (the ceiling recomputed from the hash ids,
tests/traces.py), independently of the code that filled the caption. One function per stop,
keyed by (lesson, stop index); a stop without one fails the test."""
from __future__ import annotations

from dataclasses import dataclass

from kvscope_contract.lab import TracePoint, TraceSweep
from app.lessons.trace_lesson import TraceLesson
from tests.lesson_claims import num
from tests.traces import ceiling_512


@dataclass
class TraceAt:
    lesson: TraceLesson
    index: int
    sweeps: list[TraceSweep]    # the sweeps of the stops reached, this one last
    values: dict[str, str]      # the caption's placeholders, as filled

    @property
    def sweep(self) -> TraceSweep:
        return self.sweeps[self.index]

    def pts(self, policy: str, tier: bool = False) -> list[TracePoint]:
        return sorted((pt for pt in self.sweep.points if pt.policy == policy and bool(pt.host_blocks) == tier),
                      key=lambda pt: pt.blocks)


def _rate(text: str) -> float:
    return float(text.rstrip("%")) / 100


def _first_full(pts: list[TracePoint], ceiling: int) -> int | None:
    """The smallest capacity from which on every point serves the ceiling (none below it does at the next)."""
    ok = [pt.hit_tokens == ceiling for pt in pts]
    starts = [i for i in range(len(pts)) if all(ok[i:])]
    return pts[starts[0]].blocks if starts else None


def t_ceiling(at: TraceAt) -> None:
    """The slice, one request at a time, through a pool that evicts nothing: its hits are the
    file's exact reuse ceiling, and the rest is cold or the last block of each prompt."""
    s = at.sweep
    lines = sum(1 for _ in open(at.lesson.path))
    hit, total = ceiling_512(at.lesson.path, lines)
    assert s.one_at_a_time and s.block_size == num(at.values["bs"]) == 512
    assert s.requests == num(at.values["requests"]) == lines
    assert s.prompt_tokens == num(at.values["prompt_tokens"]) == total
    (pt,) = s.points
    assert pt.evictions == num(at.values["evictions"]) == 0
    assert pt.blocks == num(at.values["capacity"]) > s.unlimited_blocks
    assert pt.hit_tokens == num(at.values["ceiling_tokens"]) == hit == s.ceiling_hit_tokens
    assert at.values["ceiling"] == f"{hit / total:.1%}"
    cold, partial = num(at.values["cold"]), num(at.values["partial"])
    assert (cold, partial) == (pt.missed["cold"], pt.missed["partial_block"]) and hit + cold + partial == total
    assert not any(pt.missed.get(r) for r in ("evicted", "in_flight", "recomputed"))


def t_policies(at: TraceAt) -> None:
    """The best policy (OPT) at or above the first (LRU) everywhere, both at or below the ceiling;
    the capacity each reaches the ceiling from, the first's several times the best's; the
    capacity where they differ most, and the first's misses there by eviction."""
    s, v = at.sweep, at.values
    first, best = at.pts(at.lesson.stops[at.index].policies[0]), at.pts(at.lesson.stops[at.index].policies[-1])
    assert [a.blocks for a in first] == [b.blocks for b in best] and len(first) == num(v["points"]) > 2
    assert all(a.hit_tokens <= b.hit_tokens <= s.ceiling_hit_tokens for a, b in zip(first, best))
    assert all(x.hit_tokens <= y.hit_tokens for x, y in zip(best, best[1:]))  # OPT: monotone in capacity
    a, b = _first_full(first, s.ceiling_hit_tokens), _first_full(best, s.ceiling_hit_tokens)
    assert (a, b) == (num(v["first_full"]), num(v["best_full"])) and a > b
    assert v["ratio"] == f"{a / b:.1f}" and a / b > 2  # "needs 6.4× the pool": several times
    gaps = [y.hit_rate - x.hit_rate for x, y in zip(first, best)]
    i = gaps.index(max(gaps))
    assert first[i].blocks == num(v["gap"]) and (v["first_gap"], v["best_gap"]) == (
        f"{first[i].hit_rate:.1%}", f"{best[i].hit_rate:.1%}")
    assert num(v["first_gap_evicted"]) == first[i].missed["evicted"]
    assert num(v["best_gap_evicted"]) == best[i].missed["evicted"] < first[i].missed["evicted"]
    bpb = s.block_size * at.lesson.bytes_per_token
    assert v["best_full_bytes"] == f"{b * bpb / 2 ** 30:,.0f} GiB"


def t_tier(at: TraceAt) -> None:
    """The first policy on the device pool where the best reached the ceiling in the stop before:
    short of it alone, and nearer with a host tier whose hits are tokens the device missed."""
    s, v = at.sweep, at.values
    before = at.sweeps[at.index - 1]
    policies = at.lesson.stops[at.index - 1].policies
    best_full = _first_full(sorted((pt for pt in before.points if pt.policy == policies[-1]), key=lambda pt: pt.blocks),
                            before.ceiling_hit_tokens)
    (alone,), (tier,) = at.pts(policies[0]), at.pts(policies[0], tier=True)
    assert alone.blocks == tier.blocks == best_full == num(v["device"])
    assert tier.host_blocks == num(v["host"]) and tier.host_hit_tokens == num(v["host_hit"]) > 0
    assert tier.hit_tokens == alone.hit_tokens  # the same device pool serves the same tokens: the tier adds
    assert alone.hit_tokens < s.ceiling_hit_tokens and v["device_rate"] == f"{alone.hit_rate:.1%}"
    assert alone.hit_tokens + tier.host_hit_tokens <= s.ceiling_hit_tokens
    assert v["tier_rate"] == f"{tier.tier_hit_rate:.1%}" and _rate(v["tier_rate"]) > _rate(v["device_rate"])
    assert v["tier_of_ceiling"] == f"{tier.tier_hit_rate / s.ceiling:.0%}"


TRACE_CLAIMS = {("sizing_real_traffic", 0): t_ceiling, ("sizing_real_traffic", 1): t_policies,
                ("sizing_real_traffic", 2): t_tier}

"""The lessons on real traffic: a script over the trace sweep (`app/lessons/trace/*.toml`), on the
bundled slice of Mooncake's conversation trace (assets/mooncake), run stop by stop, each caption
filled with the numbers of its own sweep. No engine and no model: each stop is `python -m
engine.lab trace:... --json` in a child process (app/link/lab_run.py), the Lab's trace sweep.

A stop does one thing:
- `ceiling`: the trace through a pool too big to evict (`capacities[0]` blocks): what any pool
  could reuse, and what none can;
- `policies`: a sweep of capacities (`capacities`, or the lab's log-spaced default) under each of
  `policies`: where each reaches the ceiling, and where they differ most;
- `tier`: the first policy at the capacity where the last one (the best) reached the ceiling in
  the `policies` stop before, without and with a host tier of `host_blocks`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from kvscope_contract.lab import TracePoint, TraceSweep
from app.lessons.lesson import read_lesson
from app.lessons.walk import ThreadedWalk
from app.link.lab_run import run_sweep
from app.link.source import ASSETS

TRACE_LESSONS_DIR = Path(__file__).resolve().parent / "trace"


class TraceStop(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    title: str
    caption: str                              # markdown; {placeholders} from `PLACEHOLDERS`
    do: Literal["ceiling", "policies", "tier"]
    policies: list[str] = msgspec.field(default_factory=lambda: ["lru", "opt"])  # the first compared, the last the best
    capacities: list[int] = []                # device blocks ([]: the lab's default points)
    host_blocks: int = 0                      # tier: the host tier's blocks


class TraceLesson(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    title: str
    goal: str
    stops: list[TraceStop]
    trace: str = "mooncake/conversation_trace_first1000.jsonl"  # under assets/, or an absolute path
    one_at_a_time: bool = True                # the paper's setting, where the ceiling is exact
    bytes_per_token: int = 327_680            # capacity in bytes for this model (the paper's 320 KB a token)
    columns: list[str] = []
    key: str = ""

    @property
    def path(self) -> Path:
        return ASSETS / self.trace


PLACEHOLDERS = {
    "requests": "requests replayed", "prompt_tokens": "their prompt tokens", "bs": "block size",
    "ceiling": "the ceiling: the share of prompt tokens an unlimited pool serves, one request at a time",
    "ceiling_tokens": "its prompt tokens", "unlimited": "the pool that never evicts on this trace, in blocks",
    "capacity": "the stop's pool (ceiling: the one too big to evict), in blocks", "evictions": "its evictions",
    "cold": "tokens missed because no earlier prompt held them", "partial": "tokens missed in the block of a "
    "prompt's last token (always computed)", "model": "whose KV bytes per token size the pool",
    "first": "the policy compared (the stop's first)", "best": "the best policy (the stop's last)",
    "points": "capacities swept", "first_full": "the smallest swept capacity where the first reaches the ceiling",
    "best_full": "the same for the best", "first_full_bytes": "first_full in KV bytes",
    "best_full_bytes": "best_full in KV bytes", "ratio": "first_full / best_full",
    "gap": "the swept capacity where the two differ most", "gap_bytes": "it in KV bytes",
    "first_gap": "the first's hit rate there", "best_gap": "the best's", "first_gap_evicted":
    "tokens the first missed there because it had evicted them", "best_gap_evicted": "the same for the best",
    "device": "tier: the device pool (the best's full capacity of the stop before)", "device_rate":
    "the first policy's hit rate there, device alone", "host": "the host tier's blocks", "host_bytes": "its KV bytes",
    "host_hit": "tokens the device missed and the host tier served", "tier_rate": "device and host tier together",
    "tier_of_ceiling": "that, as a share of the ceiling", "device_of_ceiling": "device alone, as a share of it",
}


def load(path: Path) -> TraceLesson:
    lesson = read_lesson(path, TraceLesson, PLACEHOLDERS, ())
    for i, stop in enumerate(lesson.stops):
        if stop.do == "ceiling" and len(stop.capacities) != 1:
            raise ValueError(f"{path.name}: stop {i + 1} (ceiling) takes one capacity, a pool too big to evict")
        if stop.do == "tier" and (stop.host_blocks < 1 or not any(s.do == "policies" for s in lesson.stops[:i])):
            raise ValueError(f"{path.name}: stop {i + 1} (tier) needs host_blocks and a `policies` stop before it")
    return lesson


def all_trace_lessons(folder: Path = TRACE_LESSONS_DIR) -> list[TraceLesson]:
    return [load(f) for f in sorted(folder.glob("*.toml"))]


def caption(stop: TraceStop, words: dict[str, str]) -> str:
    return stop.caption.format_map(words)


# ------------------------------------------------------------------------------ the numbers
def pct(x: float) -> str:
    return f"{x:.1%}"


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 2 ** 30:,.0f} GiB" if n_bytes >= 10 * 2 ** 30 else f"{n_bytes / 2 ** 30:,.2f} GiB"


def curve(s: TraceSweep, policy: str) -> list[TracePoint]:
    """A policy's device-only points, by capacity."""
    return sorted((pt for pt in s.points if pt.policy == policy and not pt.host_blocks), key=lambda pt: pt.blocks)


def full_at(s: TraceSweep, policy: str) -> int | None:
    """The smallest swept capacity from which on the policy serves every token the ceiling holds."""
    pts = curve(s, policy)
    full = None
    for pt in reversed(pts):
        if pt.hit_tokens != s.ceiling_hit_tokens:
            break
        full = pt.blocks
    return full


def widest_gap(s: TraceSweep, first: str, best: str) -> tuple[TracePoint, TracePoint]:
    """The two policies' points at the swept capacity where their hit rates differ most."""
    pairs = list(zip(curve(s, first), curve(s, best)))
    return max(pairs, key=lambda ab: (ab[1].hit_rate - ab[0].hit_rate, -ab[0].blocks))


def words(lesson: TraceLesson, stop: TraceStop, s: TraceSweep) -> dict[str, str]:
    """The stop's placeholders, from its sweep `s`."""
    bpb = s.block_size * lesson.bytes_per_token
    w = {"requests": f"{s.requests:,}", "prompt_tokens": f"{s.prompt_tokens:,}", "bs": f"{s.block_size}",
         "ceiling": pct(s.ceiling), "ceiling_tokens": f"{s.ceiling_hit_tokens:,}",
         "unlimited": f"{s.unlimited_blocks:,}",
         "model": f"the paper's model, {lesson.bytes_per_token / 1024:,.0f} KiB of KV a token"}
    if stop.do == "ceiling":
        (pt,) = s.points
        w |= {"capacity": f"{pt.blocks:,}", "evictions": f"{pt.evictions:,}",
              "cold": f"{pt.missed.get('cold', 0):,}", "partial": f"{pt.missed.get('partial_block', 0):,}"}
    elif stop.do == "policies":
        first, best = stop.policies[0], stop.policies[-1]
        a, b = full_at(s, first), full_at(s, best)
        lo, hi = widest_gap(s, first, best)
        w |= {"first": first.upper(), "best": best.upper(), "points": f"{len(curve(s, first))}",
              "first_full": f"{a:,}" if a else "none of them", "best_full": f"{b:,}" if b else "none of them",
              "first_full_bytes": gib(a * bpb) if a else "-", "best_full_bytes": gib(b * bpb) if b else "-",
              "ratio": f"{a / b:.1f}" if a and b else "-", "gap": f"{lo.blocks:,}", "gap_bytes": gib(lo.blocks * bpb),
              "first_gap": pct(lo.hit_rate), "best_gap": pct(hi.hit_rate),
              "first_gap_evicted": f"{lo.missed.get('evicted', 0):,}",
              "best_gap_evicted": f"{hi.missed.get('evicted', 0):,}"}
    else:
        alone, tier = (next(pt for pt in s.points if bool(pt.host_blocks) == h) for h in (False, True))
        w |= {"first": alone.policy.upper(), "device": f"{alone.blocks:,}", "device_rate": pct(alone.hit_rate),
              "device_of_ceiling": f"{alone.hit_rate / s.ceiling:.0%}" if s.ceiling else "-",
              "host": f"{tier.host_blocks:,}", "host_bytes": gib(tier.host_blocks * bpb),
              "host_hit": f"{tier.host_hit_tokens:,}", "tier_rate": pct(tier.tier_hit_rate),
              "tier_of_ceiling": f"{tier.tier_hit_rate / s.ceiling:.0%}" if s.ceiling else "-"}
    return w


def marked(stop: TraceStop, s: TraceSweep) -> dict:
    """The point the stop's chart marks (app/modes/lab_trace_view.py `chart`): the ceiling's one
    point, the first policy where it trails the best most, or the device pool with its host tier."""
    if stop.do == "ceiling":
        pt, label = s.points[0], "nothing evicted"
    elif stop.do == "policies":
        pt, label = widest_gap(s, stop.policies[0], stop.policies[-1])[0], "the widest gap"
    else:
        pt, label = next(pt for pt in s.points if pt.host_blocks), f"with {s.points[-1].host_blocks:,} host blocks"
    return {"blocks": pt.blocks, "policy": pt.policy, "hit rate": pt.tier_hit_rate,
            "label": f"{pt.policy.upper()} {pt.tier_hit_rate:.1%}: {label}",
            "description": f"marked: {pt.policy} at {pt.blocks} blocks, {label}: hit rate {pt.tier_hit_rate:.4f}"}


def tier_device(lesson: TraceLesson, index: int, sweeps: list[TraceSweep]) -> int:
    """A tier stop's device pool: where the best policy of the last `policies` stop before it
    reached the ceiling (its largest capacity if it never did)."""
    i = max(j for j in range(index) if lesson.stops[j].do == "policies")
    policies = lesson.stops[i].policies
    return full_at(sweeps[i], policies[-1]) or curve(sweeps[i], policies[-1])[-1].blocks


# ------------------------------------------------------------------------------ a run
@dataclass
class TraceLessonRun(ThreadedWalk):
    lesson: TraceLesson
    reached: list[dict[str, str]] = field(default_factory=list)   # each reached stop's words
    sweeps: list[TraceSweep] = field(default_factory=list)         # each reached stop's sweep
    viewing: int = -1
    pending: int | None = None
    progress: str = ""
    errors: list[str] = field(default_factory=list)
    _thread = None

    def words(self) -> dict[str, str]:
        return self.reached[self.viewing]

    def sweep(self) -> TraceSweep:
        return self.sweeps[self.viewing]

    def command(self, index: int) -> tuple[list[str], list[int], int]:
        """Stop `index`'s policies, capacities and host tier (the stops before it reached)."""
        stop = self.lesson.stops[index]
        if stop.do == "ceiling":
            return stop.policies[:1], stop.capacities, 0
        if stop.do == "tier":
            return stop.policies[:1], [tier_device(self.lesson, index, self.sweeps)], stop.host_blocks
        return stop.policies, stop.capacities, 0

    def _reach(self, index: int) -> None:
        stop = self.lesson.stops[index]
        try:
            policies, capacities, host = self.command(index)
            s = run_sweep(self.lesson.path, policies, capacities or None, one_at_a_time=self.lesson.one_at_a_time,
                          bytes_per_token=self.lesson.bytes_per_token, host_blocks=host,
                          progress=lambda line: setattr(self, "progress", line))
            self.sweeps.append(s)
            self.reached.append(words(self.lesson, stop, s))
            self.viewing = index
        except Exception as e:  # said on the page; Restart starts over
            self.errors.append(f"stop {index + 1}: {e}")
        finally:
            self.pending = None

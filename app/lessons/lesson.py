"""Guided lessons as data: each `app/lessons/*.toml` is a script over the live engine, and this
reads it and words each stop with the run's own numbers.

A lesson is a list of stops. Before running to a stop, it may reset the pool and submit
requests; then the engine runs until an event of the stop's kinds (`run_until`), or for a number
of steps, and pauses there. The stop's caption is a template filled from the pool at that moment
(`context`): the blocks involved (highlighted in the grid and the tables), their tables, the
header's numbers, the model's sizes. `record` keeps a few numbers under a name; `{records}`
shows every kept row side by side.
"""
from __future__ import annotations

import math
import string
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

from kvscope_contract import protocol as p
from kvscope_contract.kinds import KINDS, kind_of, touched_blocks
from kvscope_contract.misses import reason_line, totals_of
from kvscope_contract.state import held_tokens
from app.derived.key_events import KEY_KINDS, block_ranges, explain
from app.lessons import hybrid
from app.derived.words import plural

L = TypeVar("L")

LESSONS_DIR = Path(__file__).resolve().parent
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
GIB = 1 << 30


class Expect(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """What a stop's caption claims about the pool beyond the event it stops at: the run goes on
    (to the next event of the stop's kinds) until every claim holds, and the tests check them."""
    finished: list[str] = []  # requests (ids) whose every sequence has finished
    running: list[str] = []   # requests with a sequence running (not waiting, not swapped)

    def unmet(self, state) -> list[str]:
        """The claims `state` (a PoolState) does not bear out, in words."""
        live = [s for s in state.seqs.values()]
        out = [f"{r} has not finished" for r in self.finished if any(s.request_id == r for s in live)]
        out += [f"{r} is not running" for r in self.running
                if not any(s.request_id == r and s.status == "running" for s in live)]
        return out


class Stop(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    caption: str                          # markdown; {placeholders} from `context`
    title: str = ""                       # a few words, for the lesson's outline
    reset: p.ResetConfig | None = None    # reset the pool to this first
    clear_prefix_cache: bool = False      # then evict every cached block no sequence holds
    submit: list[p.Submit] = []           # then submit these
    until: list[str] = []                 # then run until an event of these kinds ...
    steps: int = 0                        # ... or run this many steps
    max_steps: int = 2000                 # a run_until gives up after this many steps
    record: str = ""                      # keep this stop's numbers under this name, for {records}
    expect: Expect = Expect()             # what must hold at the stop besides its event (see Expect)
    panel: str = ""                       # the history panel under the grid shown at this stop (its name)

    def __post_init__(self) -> None:
        if bool(self.until) == bool(self.steps):
            raise ValueError("a stop runs either `until` some event kinds or a number of `steps`")
        if unknown := sorted(set(self.until) - set(p.EVENT_KINDS)):
            raise ValueError(f"unknown event kinds {unknown}")


class Lesson(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    title: str
    goal: str                   # what the lesson shows, in a sentence or two (shown before it starts)
    stops: list[Stop]
    columns: list[str] = []     # what {records} shows (default: the numbers that differ between records)
    # a bundled model (engine.serve.server --model) with sliding-window layers that the lesson needs: on an
    # engine whose pool has one KV-cache group, the Lessons mode starts an engine of it (one click)
    model: str = ""
    key: str = ""               # the file's name, set by `load`


def load(path: Path) -> Lesson:
    """Read and check a lesson file; errors name the file and the field."""
    lesson = read_lesson(path, Lesson, PLACEHOLDERS, RECORDED)
    if not lesson.stops or lesson.stops[0].reset is None:
        raise ValueError(f"{path.name}: the first stop must reset the pool (a lesson starts from a known pool)")
    if lesson.stops[0].reset.num_offload_blocks is msgspec.UNSET:  # no host tier unless the lesson asks for one
        lesson.stops[0].reset.num_offload_blocks = 0
    return lesson


def read_lesson(path: Path, kind: type[L], placeholders, recorded) -> L:
    """A lesson file of `kind` (stops with captions, `columns`, `key`), its captions' placeholders
    and its columns checked against those known: errors name the file and the field."""
    try:
        lesson = msgspec.convert(tomllib.loads(path.read_text()), kind)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"{path.name}: {e}") from None
    for i, stop in enumerate(lesson.stops):
        if bad := sorted(set(_fields(stop.caption)) - set(placeholders)):
            raise ValueError(f"{path.name}: stop {i + 1}'s caption names unknown placeholders {bad}")
    if bad := sorted(set(lesson.columns) - set(recorded)):
        raise ValueError(f"{path.name}: `columns` names unknown numbers {bad}; known: {', '.join(recorded)}")
    lesson.key = path.stem
    return lesson


def all_lessons(folder: Path = LESSONS_DIR) -> list[Lesson]:
    return [load(f) for f in sorted(folder.glob("*.toml"))]


def _fields(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f]


# ------------------------------------------------------------------------------ captions
PLACEHOLDERS = {
    "what": "what stopped the run, in words (the key-event line for a key event)",
    "blocks": "the blocks involved (highlighted), as ranges", "nblocks": "how many",
    "seq": "the sequence the stop is about", "table": "its block table, logical → physical",
    "tables": "every live sequence's table", "tokens": "its tokens in the cache",
    "prompt": "its prompt tokens", "pblocks": "blocks its prompt needs", "hits": "its prefix hits this step",
    "prefill": "prompt tokens the step computed",
    "last_fill": "tokens in its last block", "bs": "block size", "total": "device blocks",
    "used": "blocks in use", "free": "free blocks", "cached": "cached blocks (no holder)", "shared": "shared blocks",
    "slot_util": "slot utilisation", "waste": "empty slots in used blocks", "entries": "block-table entries",
    "reserved_slots": "slots a contiguous prompt + max-tokens reservation holds", "paged_slots": "slots paging holds",
    "saved_pct": "how much less paging holds",
    "ended": "how the finished sequence's answer ended: before its max tokens (the reservation it never touched) "
             "or at them", "reserved_mib": "the reservation in MiB", "paged_mib": "paging in MiB",
    "hit_tokens": "prompt tokens served by the cache", "hit_rate": "prefix hit rate",
    "looked_up": "tokens looked up in the prefix cache",
    "why": "why the others missed, by reason, since the lesson last reset the pool (the panel's words)",
    "why_seq": "the stop's sequence's last admission: its hit, and why the rest missed",
    "cows": "copies on write", "forks": "forks", "preemptions": "preemptions", "recomputes": "recompute preemptions",
    "swap_outs": "swaps out", "swap_ins": "swaps in", "moved": "blocks copied by swaps in this step",
    "host_loads": "blocks loaded from the host tier instead of computed, since the lesson last reset the pool",
    "lost": "tokens dropped by recompute preemptions in this step (computed again later)",
    "hash": "the stop event's block hash", "parent_hash": "its parent's hash",
    "model": "model", "layers": "layers", "kv_heads": "KV heads", "head_dim": "head dim", "dtype": "dtype",
    "dtype_bytes": "bytes per element", "bytes_per_block": "bytes per block", "kib_per_block": "KiB per block",
    "bytes_per_token": "bytes of KV cache per token",
    "blocks_per_gib": "blocks 1 GiB buys", "tokens_per_gib": "tokens 1 GiB holds",
    "seqs_per_gib": "sequences of 2,048 tokens 1 GiB holds", "pool_mib": "the device pool in MiB",
    "records": "the numbers kept by earlier stops, side by side",
    **hybrid.PLACEHOLDERS,
}
RECORDED = ("bs", "total", "used", "slot_util", "waste", "entries", "paged_slots", "reserved_slots", "hit_rate",
            "preemptions", "recomputes", "swap_outs", "moved", "lost", "hit_tokens", "host_loads", "prefill")


@dataclass(frozen=True)
class Focus:
    """What a stop points at: the events that stopped the run and their blocks."""
    events: list          # the step's events of the stop's kinds (or the step's last events)
    blocks: list[int]     # device blocks to highlight
    what: str             # one line
    step_events: list     # every event of the step


def focus(stop: Stop, step_events: list[p.AnyEvent], at: int | None, state) -> Focus:
    """The events a stop is about: for `until`, those of its kinds in the step (the one at `at`
    first); for `steps`, the sequences that ran in the last step."""
    if stop.until and at is not None:
        hit = next((e for e in step_events if e.seq == at), None)
        kind = kind_of(hit) if hit else stop.until[0]
        key = explain(step_events, at, state) if kind in KEY_KINDS else None
        events = [e for e in step_events if kind_of(e) == kind]
        blocks = list(dict.fromkeys(b for e in events for b in touched_blocks(e)[0]))
        if kind in ("preempt", "finish"):  # no block of their own: the blocks they give up in the step
            who = {e.seq_id for e in events}
            blocks = list(dict.fromkeys(b for e in step_events if isinstance(e, (p.Free, p.SwapOut))
                                        and e.seq_id in who for b in touched_blocks(e)[0]))
        if kind in ("status", "window_free"):  # a hybrid lesson's stops: an admission, a window that moved
            return Focus(*hybrid.focus(kind, events, step_events), step_events)
        if key:
            what = key.text
        elif kind == "finish":
            what = (f"{', '.join(e.seq_id for e in events)} finished; blocks {block_ranges(blocks) or 'none'} "
                    "went back to the pool")
        else:
            what = f"{KINDS[kind].label}: {plural(len(events), 'event')}, blocks {block_ranges(blocks)}"
        return Focus(events, blocks or (key.blocks if key else []), what, step_events)
    ran = [e for e in step_events if isinstance(e, p.Append)]
    seqs = [s for i in dict.fromkeys(e.seq_id for e in ran) if (s := state.seqs.get(i)) and s.num_tokens]
    blocks = [t[(s.num_tokens - 1) // state.config.block_size] for s in seqs for t in s.block_tables
              if len(t) > (s.num_tokens - 1) // state.config.block_size]  # every KV-cache group's
    return Focus(ran, blocks, f"{plural(len(seqs), 'sequence')} computed tokens; the blocks holding their "
                 "newest token are highlighted", step_events)




def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB"


def _pct(x: float) -> str:
    return f"{x:.0%}"


def context(fx: Focus, mirror, before, engine: p.EngineInfo | None, records: dict[str, dict],
            columns: list[str] = (), admissions: list = ()) -> dict[str, str]:
    """Every placeholder's value at a stop. `mirror` is the pool after the stop's step, `before`
    the pool just before it (or None); `admissions` the admissions explained
    (kvscope_contract/misses.py) since the lesson last reset the pool, up to the stop."""
    pool, cfg, tl = mirror.state, mirror.config, mirror.tally
    u = mirror.usage()
    bs = cfg.block_size
    seq_id = next((getattr(e, "seq_id", "") for e in fx.events if getattr(e, "seq_id", "")), "")
    seq = pool.seqs.get(seq_id) if seq_id else next(iter(pool.seqs.values()), None)
    seq_id = seq_id or (seq.seq_id if seq else "-")
    ev = fx.events[-1] if fx.events else None
    hits = sum(1 for e in fx.step_events if isinstance(e, p.PrefixHit) and e.seq_id == seq_id)
    bpb = cfg.bytes_per_block or 0
    dtype = engine.dtype if engine else "?"
    out = {
        "what": fx.what, "blocks": block_ranges(fx.blocks) or "none", "nblocks": str(len(fx.blocks)),
        "seq": seq_id, "table": _table(seq), "tables": " · ".join(
            f"{s.seq_id}: {_table(s)}" for s in pool.seqs.values() if s.block_table) or "no sequence holds blocks",
        "tokens": str(seq.num_tokens if seq else 0), "prompt": str(seq.prompt_tokens if seq else 0),
        "pblocks": str(math.ceil((seq.prompt_tokens if seq else 0) / bs)), "hits": str(hits),
        "last_fill": str(held_tokens(seq.num_tokens, len(seq.block_table) - 1, bs) if seq and seq.block_table else 0),
        "bs": str(bs), "total": str(cfg.num_device_blocks), "used": str(u["used"]), "free": str(u["free"]),
        "cached": str(u["cached"]), "shared": str(u["shared"]), "slot_util": _pct(u["slot_util"]),
        "waste": str(round(u["waste_per_seq"] * sum(1 for s in pool.seqs.values() if s.block_table))),
        "entries": str(sum(len(s.block_table) for s in pool.seqs.values())),
        "reserved_slots": f"{u['reserved_slots']:,}", "paged_slots": f"{u['paged_slots']:,}",
        "saved_pct": _pct(1 - u["paged_slots"] / u["reserved_slots"]) if u["reserved_slots"] else "0%",
        "reserved_mib": _mib(u["reserved_bytes"]), "paged_mib": _mib(u["paged_bytes"]),
        "hit_tokens": f"{tl.hit_tokens:,}", "hit_rate": _pct(tl.hit_rate), "cows": str(tl.cows),
        "forks": str(tl.forks), "preemptions": str(tl.preemptions), "recomputes": str(tl.recomputes),
        "swap_outs": str(tl.swap_outs), "swap_ins": str(tl.swap_ins), "host_loads": str(tl.host_loaded_blocks),
        "prefill": f"{sum(e.prefill_tokens for e in fx.step_events if isinstance(e, p.StepDone)):,}",
        "moved": str(sum(len(e.mapping) for e in fx.step_events if isinstance(e, (p.SwapOut, p.SwapIn)))),
        "lost": str(sum(before.state.seqs[e.seq_id].num_tokens for e in fx.step_events if isinstance(e, p.Preempt)
                        and e.mode == "recompute" and before is not None and e.seq_id in before.state.seqs)),
        "hash": getattr(ev, "hash", "") or "-",
        "parent_hash": getattr(ev, "parent_hash", None) or "none (a first block)",
        "model": engine.model if engine else "?", "layers": str(engine.num_layers if engine else "?"),
        "kv_heads": str(engine.num_kv_heads if engine else "?"), "head_dim": str(engine.head_dim if engine else "?"),
        "dtype": dtype, "dtype_bytes": str(DTYPE_BYTES.get(dtype, "?")), "bytes_per_block": f"{bpb:,}",
        "kib_per_block": f"{bpb / 1024:,.1f}", "bytes_per_token": f"{bpb // bs:,}",
        "blocks_per_gib": f"{GIB // bpb:,}" if bpb else "?",
        "tokens_per_gib": f"{GIB // bpb * bs:,}" if bpb else "?",
        "seqs_per_gib": f"{GIB // bpb * bs // 2048:,}" if bpb else "?",
        "pool_mib": _mib(bpb * cfg.num_device_blocks),
    }
    out["ended"] = _ended(fx, mirror, before)
    out["records"] = records_table(records, columns)
    out["looked_up"] = f"{tl.looked_up_tokens:,}"
    out["why"] = reason_line(totals_of(admissions).by_reason, words=True) or "nothing missed"
    mine = [a for a in admissions if a.seq_id == seq_id]
    out["why_seq"] = "not admitted yet"
    if mine:
        last = mine[-1]
        out["why_seq"] = (f"{last.hit:,} of its {last.tokens:,} tokens hit; "
                          f"{reason_line(last.by_reason(), words=True) or 'nothing'} missed")
    out |= hybrid.context(fx, mirror, u, seq)
    return out


def _ended(fx: Focus, mirror, before) -> str:
    """How the answer of the first sequence that finished in the stop's step ended."""
    fin = next((e for e in fx.events if isinstance(e, p.Finish)), None)
    done = next((f for f in reversed(mirror.finished) if fin and f.seq_id == fin.seq_id), None)
    seq = before.state.seqs.get(fin.seq_id) if fin and before is not None else None
    if done is None or seq is None:
        return "?"
    out, most = done.output_tokens, seq.max_tokens
    if out < most:
        return (f"{fin.seq_id} stopped after {plural(out, 'token')} of the {most:,} it was allowed, so "
                f"{plural(most - out, 'reserved slot')} were never touched")
    return (f"{fin.seq_id} ran to its max of {plural(most, 'token')}, so its whole reservation was used, "
            "the last of it only at the last step")


def _table(seq) -> str:
    if seq is None or not seq.block_table:
        return "(no blocks)"
    pairs = [f"{i}→{b}" for i, b in enumerate(seq.block_table[:24])]
    return "[" + ", ".join(pairs) + (f", … {len(seq.block_table) - 24} more" if len(seq.block_table) > 24 else "") + "]"


def recorded(values: dict[str, str]) -> dict[str, str]:
    return {k: values[k] for k in RECORDED}


def records_table(records: dict[str, dict], columns: list[str] = ()) -> str:
    """Markdown: one row per record; the columns given, else those that differ between them."""
    if not records:
        return "(nothing recorded yet)"
    rows = list(records.items())
    differ = [k for k in RECORDED if len(rows) == 1 or len({r[k] for _, r in rows}) > 1]
    cols = list(columns) or differ or list(RECORDED)
    names = {"bs": "block size", "total": "blocks", "used": "used", "slot_util": "slot util", "waste": "empty slots",
             "entries": "table entries", "paged_slots": "paged slots", "reserved_slots": "reserved slots",
             "hit_rate": "hit rate", "preemptions": "preemptions", "recomputes": "recomputes",
             "swap_outs": "swaps out", "moved": "blocks copied", "lost": "tokens lost", "hit_tokens": "hit tokens",
             "host_loads": "blocks loaded from the host tier", "prefill": "prompt tokens computed"}
    head = "| | " + " | ".join(names[c] for c in cols) + " |\n|---|" + "---:|" * len(cols) + "\n"
    return head + "\n".join(f"| {name} | " + " | ".join(r[c] for c in cols) + " |" for name, r in rows)


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def caption(stop: Stop, values: dict[str, str]) -> str:
    return stop.caption.format_map(_Missing(values))

"""The dashboard's mirror of the engine: the reducer's PoolState plus what the views derive
from the events themselves (counters, rates, where each table entry came from).

`Mirror.apply` is as pure as the reducer it wraps, so checkpoints (`clone`) and replays of
the event history give the same answers live and in time travel.
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field, replace

import msgspec
import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.counters import STREAM_COUNTERS, StreamCounts
from kvscope_contract.state import PoolState
from app.history import groups
from app.history.block_text import BlockTexts

RATE_STEPS = 16     # tokens/s: the tokens generated in the last this many engine steps over their durations
FINISHED_KEPT = 12   # finished requests listed in the tables view


@dataclass
class Tally(StreamCounts):
    """Counters of the events seen since `since` (the engine's start, this client's attach,
    a reset, or a clean slate): a client counts only what it saw, or what the server's snapshot
    said the events a resync skipped counted. Hits, lookups, preemptions, swaps, requests and
    tokens are the contract's `StreamCounts` (one fold for every consumer)."""
    since: str = "engine start"
    last_step: p.StepDone | None = None
    # (tokens generated, duration_ms) of the last RATE_STEPS engine steps, and the tokens of the step under way
    steps: deque = field(default_factory=lambda: deque(maxlen=RATE_STEPS), repr=False)
    step_tokens: int = 0

    def tokens_per_s(self) -> float:
        """Tokens generated per second of the engine's own step time, over the last RATE_STEPS
        completed steps (their `duration_ms`): a function of the events alone, so the same at an
        event however it is reached, and steady while the engine is paused."""
        ms = sum(d for _, d in self.steps)
        return 1000 * sum(n for n, _ in self.steps) / ms if ms > 0 else 0.0

    def clone(self) -> Tally:
        return replace(self, steps=deque(self.steps, maxlen=RATE_STEPS), preempted=set(self.preempted))

    def after(self, base: StreamCounts, since: str) -> Tally:
        """What these counters counted after `base` (the same counters read at an earlier event
        of the same slate), labelled `since`; the rate and the last step are this one's."""
        out = replace(self.clone(), since=since)
        for name in STREAM_COUNTERS:
            setattr(out, name, getattr(self, name) - getattr(base, name))
        return out

    def counted_nothing(self) -> bool:
        return not any(getattr(self, name) for name in STREAM_COUNTERS)


def less(server: p.Counters, tally: StreamCounts) -> p.Counters:
    """The server's counters less a tally's (what the server had counted when the tally began)."""
    return msgspec.structs.replace(server, preempted=[], **{n: getattr(server, n) - getattr(tally, n)
                                                            for n in STREAM_COUNTERS})


@dataclass
class Finished:
    seq_id: str
    reason: str
    text: str
    output_tokens: int


@dataclass
class Mirror:
    state: PoolState
    tally: Tally = field(default_factory=Tally)
    # seq_id -> {(KV-cache group, logical index): "prefix_hit" | "cow" | "window_free"}: how a table
    # entry was obtained (or, "window_free", why it is empty), for the tables view
    origins: dict[str, dict[tuple[int, int], str]] = field(default_factory=dict)
    finished: deque = field(default_factory=lambda: deque(maxlen=FINISHED_KEPT))  # Finished, newest last
    t: float = 0.0  # engine time of the last event applied
    texts: BlockTexts = field(default_factory=BlockTexts)  # shared by every copy: see block_text.py
    # The server's own counters less this tally's: what it had counted when the tally began (None:
    # the server sends none). Both fold the same events alike, so it stays put between a reset, a
    # clean slate and a resync; at a resync the tally becomes the snapshot's counters less it.
    server_base: p.Counters | None = None

    @classmethod
    def from_snapshot(cls, snap: p.Snapshot) -> Mirror:
        since = f"you attached (event {snap.seq:,})" if snap.seq else "engine start"
        return cls(PoolState.from_snapshot(snap), Tally(since=since),
                   texts=BlockTexts(snap.config.block_size, snap.seq), server_base=snap.counters)

    def start_tally(self, since: str) -> None:
        """Count from here on (a clean slate); the pool itself is untouched."""
        old = self.tally  # the rate is not a counter: it carries on
        if (b := self.server_base) is not None:  # the server counted on: its count when this tally begins
            self.server_base = msgspec.structs.replace(
                b, **{n: getattr(b, n) + getattr(old, n) for n in STREAM_COUNTERS})
        self.tally = Tally(since=since, last_step=old.last_step, steps=deque(old.steps, maxlen=RATE_STEPS),
                           step_tokens=old.step_tokens, preempted=set(old.preempted))

    def carry_on(self, old: Mirror, counters: p.Counters | None) -> None:
        """This mirror, from a snapshot in mid-stream, carries on from `old` (the live one before it):
        its counters, finished requests, texts and table origins. `counters`: the snapshot's. What the
        events skipped counted is taken from them; without them (a server that keeps none) they are lost."""
        self.tally, self.finished, self.t, self.texts = old.tally.clone(), old.finished, old.t, old.texts
        self.origins = {k: v for k, v in old.origins.items() if k in self.state.seqs}
        base = old.server_base
        if counters is None:
            self.server_base = None
            return
        if base is None:  # from here on, exact
            self.server_base = less(counters, old.tally)
        else:
            if base.since != counters.since:  # a reset among the events skipped: count from it
                self.tally = Tally(since=f"the reset (event {counters.since:,})", last_step=old.tally.last_step)
                base = p.Counters(since=counters.since)
            for name in STREAM_COUNTERS:
                setattr(self.tally, name, getattr(counters, name) - getattr(base, name))
            self.server_base = base
        self.tally.preempted = set(counters.preempted)

    @property
    def last_event(self) -> int:
        return self.state.last_event

    @property
    def config(self) -> p.PoolConfig:
        return self.state.config

    def clone(self) -> Mirror:
        c = copy.copy(self)
        c.state, c.tally = self.state.clone(), self.tally.clone()
        c.origins = {k: dict(v) for k, v in self.origins.items()}
        c.finished = deque(self.finished, maxlen=self.finished.maxlen)
        return c

    def apply(self, ev: p.AnyEvent) -> None:
        """Apply one event; raises kvscope_contract.state.InvariantError (and changes nothing of the
        derived data) when it cannot follow."""
        before = self.state.seqs.get(getattr(ev, "seq_id", ""))  # the reducer updates it in place
        text = before.text if before else ""
        looked_up, hit = self.state.prefix_lookup(ev), self.state.prefix_hit_tokens(ev)
        self.state.apply(ev)
        self.texts.apply(ev, self.state)
        self.t = ev.t
        tl = self.tally
        tl.count(ev, looked_up, hit)
        match ev:
            case p.Alloc():
                self.origins.get(ev.seq_id, {}).pop((ev.kv_group, ev.logical_index), None)
            case p.PrefixHit():
                self.origins.setdefault(ev.seq_id, {})[ev.kv_group, ev.logical_index] = "prefix_hit"
            case p.OffloadLoad():
                self.origins.setdefault(ev.seq_id, {})[ev.kv_group, ev.logical_index] = "offload_load"
            case p.Cow():
                self.origins.setdefault(ev.seq_id, {})[ev.kv_group, ev.logical_index] = "cow"
            case p.WindowFree():
                self.origins.setdefault(ev.seq_id, {})[ev.kv_group, ev.logical_index] = "window_free"
            case p.Fork():
                self.origins[ev.seq_id] = dict(self.origins.get(ev.parent_seq_id, {}))
            case p.Preempt() | p.SwapIn():
                self.origins.pop(ev.seq_id, None)
            case p.Append() if ev.token_ids:
                tl.step_tokens += len(ev.token_ids)
            case p.Finish():
                self.origins.pop(ev.seq_id, None)
                out = before.output_tokens if before else 0
                self.finished.append(Finished(ev.seq_id, ev.reason, text, out))
            case p.StepDone():
                tl.last_step = ev
                tl.steps.append((tl.step_tokens, ev.duration_ms))
                tl.step_tokens = 0
            case p.Reset():
                self.tally, self.origins = Tally(since=f"the reset (event {ev.seq:,})"), {}
                if self.server_base is not None:  # the server counts from its reset too
                    self.server_base = p.Counters(since=ev.seq)

    # ------------------------------------------------------------------ derived numbers
    def usage(self, states: np.ndarray | None = None) -> dict:
        """The numbers the header shows: pool and host usage, slot utilisation (internal
        fragmentation), and a contiguous prompt + max-tokens reservation next to paging; on a
        hybrid pool also the blocks by kind of KV-cache group (`kinds`) and what full attention
        on every layer would hold (`full_everywhere`, blocks). `states`: the state's
        `block_states()`, when the caller has them already."""
        pool, cfg = self.state, self.state.config
        states = pool.block_states() if states is None else states
        free, cached, used, shared, host_used = pool.counts(states)
        bs, bpb = cfg.block_size, cfg.bytes_per_block
        holding = [s for s in pool.seqs.values() if s.holds_blocks()]
        # Paging holds each physical block once, however many sequences share it.
        paged_slots = used * bs
        tokens_in_blocks = pool.tokens_in_used_blocks(states)
        kinds = groups.by_kind(pool, states)  # a hybrid pool: a reservation per group, a window's never more than W
        if kinds:
            reserved, stored = sum(k.reserved for k in kinds), sum(k.reserved_tokens for k in kinds)
        else:
            reserved, stored = sum(s.prompt_tokens + s.max_tokens for s in holding), sum(s.num_tokens for s in holding)
        return dict(
            free=free, cached=cached, used=used, total=cfg.num_device_blocks, shared=shared,
            host_used=host_used, host_total=cfg.num_host_blocks,
            slot_util=tokens_in_blocks / paged_slots if paged_slots else 1.0,
            stored_tokens=stored, paged_slots=paged_slots, paged_bytes=used * bpb,
            reserved_slots=reserved, reserved_bytes=reserved * bpb / bs,
            reserved_util=stored / reserved if reserved else 1.0,
            waste_per_seq=(paged_slots - tokens_in_blocks) / len(holding) if holding else 0.0,
            holding=len(holding), kinds=kinds,
            full_everywhere=groups.full_attention_everywhere(pool, kinds) if kinds else used,
        )

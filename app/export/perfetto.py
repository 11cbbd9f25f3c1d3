"""A KVScope event stream as a Perfetto trace (native TrackEvent protobuf), to open at
ui.perfetto.dev or in trace_processor:

    kvscope-export RECORDING.jsonl -o run.pftrace

- a track per request (its first sequence's phases), a child track per forked sequence; the
  phases are slices: waiting, running, swapped out, preempted (recomputed, waiting again);
  a finish is an instant `finished: REASON` that ends the last phase;
- a flow from a parent's `fork` instant to each child's first slice;
- instants for copy-on-write, swap out/in and preemption on the sequence's track, and for
  evictions on an `evictions` track, with the block ids in their arguments;
- pool counters at each engine step, from the project's reducer (kvscope_contract/state.py):
  free, cached, used, shared blocks, host blocks in use, slot utilisation, prefix hit rate, and
  the tokens the prefix cache missed so far by reason (kvscope_contract/misses.py, docs/misses.md);
- an instant at each admission on its sequence's track, `prefix lookup: H of N hit`, with its
  missed tokens by reason in the arguments, and a flow from each eviction that came before the
  reuse (the `evict` instant) to it.

Timestamps are the events' own engine times (`t`, seconds) in nanoseconds. No torch, no I/O
beyond the CLI: `TraceExport` is fed events one by one (the dashboard feeds its history).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent, TracePacket
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from kvscope_contract import protocol as p
from kvscope_contract.misses import REASONS, Admission, MissExplainer
from kvscope_contract.rebuild import with_rebuilt_prompts
from kvscope_contract.recording import Recording
from kvscope_contract.state import PoolState
from app.link.source import ASSETS, is_bundled, recording_path

SEQUENCE_ID = 1  # every packet comes from one writer
COUNTERS = ("free blocks", "cached blocks", "used blocks", "shared blocks", "host blocks in use",
            "slot utilisation", "prefix hit rate")
MISS_COUNTERS = {reason: f"prefix misses: {reason}" for reason in REASONS}  # tokens, since the start or a reset
PHASES = {"waiting": "waiting", "running": "running", "swapped": "swapped out"}
PREEMPTED = "preempted"  # a recompute preemption's waiting, until it runs again


def ns(t: float) -> int:
    return round(t * 1e9)


def pool_counters(state: PoolState, hit_tokens: int, looked_up: int) -> dict[str, float]:
    """The counters at this state: block counts, slot utilisation (tokens in the used blocks
    over their slots; 1 with none used) and prefix hit rate (hit tokens over looked up, 0 before any)."""
    free, cached, used, shared, host_used = state.counts()
    slots = used * state.config.block_size
    return dict(zip(COUNTERS, (free, cached, used, shared, host_used,
                               state.tokens_in_used_blocks() / slots if slots else 1.0,
                               hit_tokens / looked_up if looked_up else 0.0)))


@dataclass
class _Seq:
    track: int
    phase: str | None = None  # the open slice's name


class TraceExport:
    """Feed it events in order (`feed`); `resync` after a gap; `serialize` gives the trace."""

    def __init__(self, start: PoolState, title: str = "KVScope"):
        self.state = start.clone()
        self.builder = TraceProtoBuilder()
        self._next_uuid = 1
        self.seqs: dict[str, _Seq] = {}
        self.requests: dict[str, int] = {}  # request_id -> its track
        self.recomputed: set[str] = set()   # preempted by recompute, not yet running again
        self.hit_tokens = self.looked_up = 0
        self.misses = MissExplainer.from_state(start, keep=0)
        self.missed: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.t = 0.0
        self._started = False
        root = self._track(title)
        self.pool_track = self._track("pool", parent=root)
        self.counter_tracks = {name: self._track(name, parent=self.pool_track, counter=True)
                               for name in (*COUNTERS, *MISS_COUNTERS.values())}
        self.evict_track = self._track("evictions", parent=self.pool_track)
        self.requests_root = self._track("requests", parent=root)

    # ------------------------------------------------------------------ packets
    def _packet(self) -> TracePacket:
        pkt = self.builder.add_packet()
        pkt.trusted_packet_sequence_id = SEQUENCE_ID
        if len(self.builder.trace.packet) == 1:
            pkt.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        return pkt

    def _track(self, name: str, parent: int | None = None, counter: bool = False) -> int:
        uuid, self._next_uuid = self._next_uuid, self._next_uuid + 1
        desc = self._packet().track_descriptor
        desc.uuid, desc.name = uuid, name
        if parent is not None:
            desc.parent_uuid = parent
        if counter:
            desc.counter.SetInParent()
        return uuid

    def _event(self, track: int, kind, name: str = "", args: dict | None = None, flow: int | None = None,
               ends_flow: int | None = None) -> TrackEvent:
        pkt = self._packet()
        pkt.timestamp = ns(self.t)
        te = pkt.track_event
        te.type, te.track_uuid = kind, track
        if name:
            te.name = name
        for key, value in (args or {}).items():
            _annotate(te.debug_annotations.add(), key, value)
        if flow is not None:
            te.flow_ids.append(flow)
        if ends_flow is not None:
            te.terminating_flow_ids.append(ends_flow)
        return te

    def _instant(self, track: int, name: str, args: dict, flow: int | None = None) -> None:
        self._event(track, TrackEvent.TYPE_INSTANT, name, args, flow=flow)

    # ------------------------------------------------------------------ sequences
    def _seq(self, seq_id: str) -> _Seq:
        s = self.seqs.get(seq_id)
        if s is None:
            rid = self.state.seqs[seq_id].request_id
            if rid not in self.requests:  # the request's first sequence draws on the request's track
                self.requests[rid] = track = self._track(rid, parent=self.requests_root)
            else:
                track = self._track(seq_id, parent=self.requests[rid])
            s = self.seqs[seq_id] = _Seq(track)
        return s

    def _set_phase(self, seq_id: str, phase: str | None, ends_flow: int | None = None) -> None:
        s = self._seq(seq_id)
        if phase == s.phase:
            return
        if s.phase is not None:
            self._event(s.track, TrackEvent.TYPE_SLICE_END)
        if phase is not None:
            self._event(s.track, TrackEvent.TYPE_SLICE_BEGIN, phase, {"seq_id": seq_id}, ends_flow=ends_flow)
        s.phase = phase

    def _phase_of(self, seq_id: str) -> str:
        status = self.state.seqs[seq_id].status
        if status == "running":
            self.recomputed.discard(seq_id)
        return PREEMPTED if status == "waiting" and seq_id in self.recomputed else PHASES[status]

    def _open_all(self) -> None:
        for seq_id in self.state.seqs:
            self._set_phase(seq_id, self._phase_of(seq_id))

    def _close_all(self, why: str) -> None:
        for seq_id, s in self.seqs.items():
            if s.phase is not None:
                self._event(s.track, TrackEvent.TYPE_SLICE_END)
                self._instant(s.track, why, {"seq_id": seq_id})
        self.seqs, self.recomputed = {}, set()

    # ------------------------------------------------------------------ events
    def feed(self, ev: p.AnyEvent) -> None:
        self.t = ev.t
        if not self._started:  # sequences alive at the start begin their phase at the first event
            self._started = True
            self._open_all()
        sid = getattr(ev, "seq_id", None)
        before = self.state.seqs.get(sid) if sid else None
        table = list(before.block_table) if before else []
        self.looked_up += self.state.prefix_lookup(ev)
        self.hit_tokens += self.state.prefix_hit_tokens(ev)
        admitted = self.misses.observe(ev, self.state)
        self.state.apply(ev)
        if admitted is not None:
            self._admission(admitted)
        match ev:
            case p.RequestAdded():
                self.requests.pop(ev.request_id, None)  # a request id used again gets a track of its own
                self._set_phase(sid, self._phase_of(sid))
            case p.Fork():
                parent = self._seq(ev.parent_seq_id)
                self._instant(parent.track, f"fork → {sid}", {"child": sid, "block_ids": ev.block_ids}, flow=ev.seq)
                self._set_phase(sid, self._phase_of(sid), ends_flow=ev.seq)
            case p.Cow():
                self._instant(self._seq(sid).track, "copy-on-write", {
                    "logical_index": ev.logical_index, "src_block_id": ev.src_block_id,
                    "dst_block_id": ev.dst_block_id})
            case p.Evict():  # a flow starts here, to the first admission that misses it (`_admission`)
                self._instant(self.evict_track, "evict", {"block_id": ev.block_id, "hash": ev.hash}, flow=ev.seq)
            case p.Preempt():
                if ev.mode == "recompute":
                    self.recomputed.add(sid)
                self._set_phase(sid, self._phase_of(sid))
                self._instant(self._seq(sid).track, f"preempt ({ev.mode})", {
                    "mode": ev.mode, "block_ids": table, **({"reason": ev.reason} if ev.reason else {})})
            case p.SwapOut() | p.SwapIn():
                name = "swap out" if isinstance(ev, p.SwapOut) else "swap in"
                src, dst = ("device_block_ids", "host_block_ids") if name == "swap out" else (
                    "host_block_ids", "device_block_ids")
                self._set_phase(sid, self._phase_of(sid))
                self._instant(self._seq(sid).track, name, {src: [a for a, _ in ev.mapping],
                                                           dst: [b for _, b in ev.mapping]})
            case p.StatusChange():
                self._set_phase(sid, self._phase_of(sid))
            case p.Finish():
                track = self._seq(sid).track
                self._set_phase(sid, None)
                self._instant(track, f"finished: {ev.reason}", {
                    "reason": ev.reason, "output_tokens": before.output_tokens if before else 0})
                del self.seqs[sid]
                self.recomputed.discard(sid)
            case p.StepDone():
                self._counters()
            case p.Reset():
                self._close_all("reset")
                self.hit_tokens = self.looked_up = 0
                self.missed = dict.fromkeys(REASONS, 0)
                self._counters()

    def _admission(self, a: Admission) -> None:
        """The lookup an admission made: an instant on its sequence's track, every missed token's
        reason in its arguments, and the end of a flow from each eviction that came before it."""
        by = a.by_reason()
        for reason, n in by.items():
            self.missed[reason] += n
        evictions = list(dict.fromkeys(e.event for s in a.spans for e in s.evictions))
        te = self._event(self._seq(a.seq_id).track, TrackEvent.TYPE_INSTANT,
                         f"prefix lookup: {a.hit:,} of {a.tokens:,} hit",
                         {"hit_tokens": a.hit, "tokens": a.tokens, "looked_up_tokens": a.looked_up,
                          "readmission": a.readmission, **{f"missed {r}": n for r, n in by.items()},
                          **({"evicted_at_events": evictions} if evictions else {})})
        te.terminating_flow_ids.extend(evictions)

    def resync(self, state: PoolState) -> None:
        """A new start after a gap in the stream: every phase ends, the new state's begin at
        its next event."""
        self._close_all("resync")
        self.state, self._started = state.clone(), False
        self.misses = MissExplainer.from_state(state, keep=0)

    def _counters(self) -> None:
        values = pool_counters(self.state, self.hit_tokens, self.looked_up)
        values.update({MISS_COUNTERS[r]: n for r, n in self.missed.items()})
        for name, value in values.items():
            te = self._event(self.counter_tracks[name], TrackEvent.TYPE_COUNTER)
            if isinstance(value, int):
                te.counter_value = value
            else:
                te.double_counter_value = value

    def serialize(self) -> bytes:
        return self.builder.serialize()


def _annotate(a, key: str, value) -> None:
    a.name = key
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int):
        a.int_value = value
    elif isinstance(value, float):
        a.double_value = value
    elif isinstance(value, (list, tuple)):
        for v in value:
            _annotate(a.array_values.add(), "", v)
        if not value:
            a.string_value = "[]"
    else:
        a.string_value = str(value)


def export(start: PoolState, events: Iterable[p.AnyEvent], title: str = "KVScope") -> bytes:
    """A start state and the events after it as a Perfetto trace (bytes). Prompts the events
    carry no token ids of are rebuilt from block hashes for the miss reasons (kvscope_contract/rebuild.py)."""
    events, _ = with_rebuilt_prompts(start, list(events))
    trace = TraceExport(start, title)
    for ev in events:
        trace.feed(ev)
    return trace.serialize()


def export_recording(path: Path) -> tuple[bytes, str]:
    """The recording's trace, and a note when it was cut short (its whole events are exported)."""
    rec = Recording(path)
    return export(PoolState.from_snapshot(rec.start), (ev for batch in rec.batches for ev in batch),
                  title=f"KVScope: {path.name}"), rec.cut_short


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export a KVScope recording as a Perfetto trace "
                                 "(open it at ui.perfetto.dev)")
    ap.add_argument("recording", help="a recording from `kvscope-engine --record`, or the name of one bundled "
                    f"in {ASSETS}: {', '.join(p.name for p in sorted(ASSETS.glob('*.jsonl')))}")
    ap.add_argument("-o", "--output", type=Path, help="the trace file (default: RECORDING with .pftrace beside it; "
                    "for a bundled recording or a read-only folder, in the current folder)")
    args = ap.parse_args(argv)
    recording = recording_path(args.recording)
    out = args.output or default_output(recording)
    try:
        data, cut_short = export_recording(recording)
    except FileNotFoundError:
        print(f"kvscope-export: no recording {args.recording!r} here, nor bundled with KVScope ({ASSETS})",
              file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"kvscope-export: {e}", file=sys.stderr)
        return 2
    out.write_bytes(data)
    if cut_short:
        print(f"kvscope-export: note: {cut_short}", file=sys.stderr)
    print(f"wrote {out} ({len(data):,} bytes): open it at https://ui.perfetto.dev")
    return 0


def default_output(recording: Path) -> Path:
    """Beside the recording; in the current folder for a bundled one (never into the installed
    package) or one in a folder we cannot write."""
    if is_bundled(recording) or not os.access(recording.resolve().parent, os.W_OK):
        return Path.cwd() / recording.with_suffix(".pftrace").name
    return recording.with_suffix(".pftrace")


if __name__ == "__main__":
    sys.exit(main())

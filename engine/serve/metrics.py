"""Prometheus metrics of the engine server, served as `GET /metrics` on its own port.

Named as vLLM v1 names them wherever vLLM has the metric (`vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_queries`, ...), so a vLLM dashboard or alert reads KVScope unchanged; the
allocator's own numbers are `kvscope_*`. Every figure comes from the events the server
publishes: the engine thread hands each batch to `observe` as it publishes it (a few counter
updates and the reducer's `apply` per event, under a lock held only that long), and a scrape
clones that mirror under the same lock and derives the gauges from the clone, on the
scraper's thread. docs/metrics.md lists the metrics and an alert rule.
"""
from __future__ import annotations

import bisect
import copy
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from kvscope_contract import protocol as p
from kvscope_contract.counters import EventCounts, StreamCounter
from kvscope_contract.misses import REASONS, MissExplainer
from kvscope_contract.residency import Mark, Residency
from kvscope_contract.state import InvariantError, PoolState

log = logging.getLogger("kvscope")

LABELS = ("model_name", "engine")  # vLLM's labels; one engine per server, index 0
ENGINE_INDEX = "0"
# vLLM 0.32's buckets for its residency histograms (`kv_cache_residency`, vllm/v1/metrics/buckets.py)
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
                     600, 1200, 1800)
RESIDENCY = {  # kvscope_contract/residency.py's metric -> vLLM's histogram, its help
    "lifetime": ("vllm:kv_block_lifetime_seconds", "Histogram of KV cache block lifetime, from leaving the "
                 "free list to returning to it (freed with no hash, or evicted). Every block."),
    "idle": ("vllm:kv_block_idle_before_evict_seconds", "Histogram of idle time before KV cache block "
             "eviction: from losing its last holder to its eviction. Every block."),
    "reuse": ("vllm:kv_block_reuse_gap_seconds", "Histogram of time gaps between uses of a cached KV block "
              "(its registration, then each prefix hit). Every block."),
}


@dataclass
class Histogram:
    """Observations per bucket of RESIDENCY_BUCKETS (the last: above them all), and their sum."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(RESIDENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(RESIDENCY_BUCKETS, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, n = [], 0
        for le, count in zip([*map(str, map(float, RESIDENCY_BUCKETS)), "+Inf"], self.counts):
            n += count
            out.append((le, n))
        return out


@dataclass
class Totals:
    """Counters since the server started (a `reset` of the pool does not reset them)."""
    prompt_tokens: int = 0       # prompt of each request, counted when its first token is sampled
    prompt_tokens_cached: int = 0  # of those, the tokens its first admission found in the prefix cache
    first_hits: dict[str, int] = field(default_factory=dict)  # sequence in its first admission -> hit tokens
    preempted: set[str] = field(default_factory=set)          # live sequences preempted at least once
    generation_tokens: int = 0   # tokens sampled
    events: EventCounts = field(default_factory=EventCounts)  # lookups, hits, preemptions, swaps
    finished: Counter = field(default_factory=Counter)        # sequences, by finish reason
    copy_on_write: int = 0
    forks: int = 0
    evictions: int = 0
    steps: int = 0
    residency: dict[str, Histogram] = field(default_factory=lambda: {k: Histogram() for k in RESIDENCY})
    miss_tokens: Counter = field(default_factory=Counter)     # missed tokens, by reason (docs/misses.md)

    def clone(self) -> Totals:
        return copy.deepcopy(self)


class EngineMetrics:
    """The engine server's metrics. `observe` runs on the engine thread; `render` on any."""

    def __init__(self, model_name: str, snapshot: Callable[[], p.Snapshot]):
        self.labels = [model_name, ENGINE_INDEX]
        self._snapshot = snapshot  # called on the engine thread only (start, resync)
        self._lock = threading.Lock()
        self._state = PoolState.from_snapshot(snapshot())
        self._misses = MissExplainer.from_state(self._state, keep=0)
        self._totals = Totals()
        self._stream = StreamCounter()  # a client's tally, sent with each snapshot (since a reset, unlike these)
        self._residency = Residency(self._residency_sample)
        self._residency.start(self._state, Mark(0, 0.0))
        self._last = Mark(0, 0.0)  # the last event observed: a rebuilt mirror's blocks count from there
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ------------------------------------------------------------------ the engine thread
    def observe(self, events: list[p.Event]) -> None:
        """Count a batch of published events and apply them to the mirror."""
        with self._lock:
            state, tot = self._state, self._totals
            try:
                for ev in events:
                    if ev.seq <= state.last_event:  # already in the snapshot the mirror began from
                        continue
                    _count(ev, state, tot)
                    self._stream.observe(ev, state)
                    if (closed := self._misses.observe(ev, state)) is not None:
                        tot.miss_tokens.update(closed.by_reason())
                    self._residency.apply(ev, state)  # applies it to the mirror
                    self._last = Mark.of(ev)
            except InvariantError:
                log.exception("metrics: the event stream broke the mirror; rebuilding it from a snapshot")
                self._state = PoolState.from_snapshot(self._snapshot())
                self._misses = MissExplainer.from_state(self._state, keep=0)
                self._residency.start(self._state, self._last)

    def counters(self) -> p.Counters:
        """A client's tally of every event observed so far (for a snapshot taken at the last of them)."""
        with self._lock:
            return self._stream.wire()

    def _residency_sample(self, metric: str, ev: p.Event, since: Mark) -> None:
        self._totals.residency[metric].observe(ev.t - since.t)

    # ------------------------------------------------------------------ a scrape
    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition (body, content type) in the classic text format, whatever `accept`
        prefers: prometheus_client's OpenMetrics writer turns the colons of vLLM's names into
        underscores in the samples (not in HELP and TYPE), so a Prometheus asking for OpenMetrics
        would store `vllm_kv_cache_usage_perc` (tests/integration/test_prometheus.py scrapes with a real one)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4

    def collect(self) -> Iterator[Metric]:
        """Called by the registry for each scrape: gauges from a clone of the mirror."""
        with self._lock:
            state, tot = self._state.clone(), self._totals.clone()
        cfg = state.config
        counts = state.counts()
        status = Counter(s.status for s in state.seqs.values())
        slots = counts.used * cfg.block_size
        yield from self._gauges([
            ("vllm:num_requests_running", "Sequences running (each sample of a request counts).",
             status["running"]),
            ("vllm:num_requests_waiting", "Sequences waiting to be admitted (new, or preempted by recompute).",
             status["waiting"]),
        ])
        # vLLM's reasons: every waiting sequence here waits for room (blocks, a batch slot); none is deferred
        yield self._by("vllm:num_requests_waiting_by_reason", "Sequences waiting, by reason: capacity (blocks "
                       "or a batch slot) or deferred (never, in KVScope's scheduler).", "reason",
                       {"capacity": status["waiting"], "deferred": 0}, ("capacity", "deferred"), GaugeMetricFamily)
        yield from self._gauges([
            ("kvscope_num_requests_swapped", "Sequences swapped out to the host pool.", status["swapped"]),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: device blocks held by a sequence over all device "
             "blocks. 1 means 100 percent usage.", counts.used / cfg.num_device_blocks),
            ("kvscope_device_blocks", "Device blocks in the pool.", cfg.num_device_blocks),
            ("kvscope_free_blocks", "Device blocks with no holder and no hash.", counts.free),
            ("kvscope_cached_blocks", "Device blocks with no holder still in the prefix cache "
             "(evictable, still hit-able).", counts.cached),
            ("kvscope_used_blocks", "Device blocks held by at least one sequence.", counts.used),
            ("kvscope_shared_blocks", "Device blocks held by two or more sequences.", counts.shared),
            ("kvscope_host_blocks", "Host (swap) blocks in the pool.", cfg.num_host_blocks),
            ("kvscope_host_used_blocks", "Host blocks holding a swapped-out block.", counts.host_used),
            ("kvscope_host_tier_blocks", "Blocks of the host tier (offloading, docs/offload.md; 0: none).",
             cfg.num_offload_blocks),
            ("kvscope_host_tier_used_blocks", "Host tier blocks holding a stored block.",
             int(state.offload_has.sum())),
            ("kvscope_block_size_tokens", "Tokens per block.", cfg.block_size),
            ("kvscope_slot_utilisation", "Tokens stored in used blocks over their slots (used blocks x "
             "block size): 1 minus the internal fragmentation. 1 when no block is used.",
             state.tokens_in_used_blocks() / slots if slots else 1.0),
        ])
        yield from self._counters([
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens: "
             "every admission, re-admissions after a recompute preemption included.", tot.events.looked_up_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             tot.events.hit_tokens),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", tot.events.preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed (each request's prompt, once).",
             tot.prompt_tokens),
            ("vllm:prompt_tokens_cached", "Number of cached prompt tokens: those each request's first "
             "admission found in the prefix cache.", tot.prompt_tokens_cached),
            ("vllm:generation_tokens", "Number of generation tokens processed.", tot.generation_tokens),
            ("kvscope_copy_on_write", "Copies of a shared block made by the first write into it.",
             tot.copy_on_write),
            ("kvscope_forks", "Sequences forked from a parent (parallel sampling).", tot.forks),
            ("kvscope_evictions", "Cached blocks evicted from the prefix cache.", tot.evictions),
            ("kvscope_engine_steps", "Engine steps run.", tot.steps),
            ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU (here: from the "
             "host tier to the device pool).", tot.events.host_loaded_blocks * cfg.bytes_per_block),
            ("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage (here: from the "
             "device pool to the host tier).", tot.events.host_stored_blocks * cfg.bytes_per_block),
        ])
        yield self._by("kvscope_host_tier_moved_blocks", "Blocks stored to the host tier, loaded back from it "
                       "on a device miss, and evicted from it.", "op",
                       {"store": tot.events.host_stored_blocks, "load": tot.events.host_loaded_blocks,
                        "evict": tot.events.host_evicted_blocks}, ("store", "load", "evict"))
        yield self._by("vllm:request_success", "Count of finished sequences, by finish reason.",
                       "finished_reason", tot.finished, p.FinishReason.__args__)
        yield self._by("kvscope_prefix_cache_miss_tokens", "Tokens an admission looked up in the prefix cache "
                       "and did not find, by reason (docs/misses.md); caching_off tokens were not looked up, "
                       "recomputed ones are re-admissions after a recompute preemption.", "reason",
                       tot.miss_tokens, tuple(REASONS))
        yield self._by("kvscope_preemptions", "Preemptions, by mode.", "mode", tot.events.preemptions_by_mode,
                       p.PreemptionMode.__args__)
        yield self._by("kvscope_swaps", "Sequences moved to the host pool (out) and back (in).",
                       "direction",
                       {"out": tot.events.swap_outs, "in": tot.events.swap_ins}, ("out", "in"))
        yield self._by("kvscope_swapped_blocks", "Blocks copied to the host pool (out) and back (in).",
                       "direction",
                       {"out": tot.events.swapped_out_blocks, "in": tot.events.swapped_in_blocks}, ("out", "in"))
        for metric, (name, doc) in RESIDENCY.items():
            h = HistogramMetricFamily(name, doc, labels=LABELS)
            h.add_metric(self.labels, tot.residency[metric].cumulative(), tot.residency[metric].total)
            yield h

    def _gauges(self, rows) -> Iterator[Metric]:
        for name, doc, value in rows:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, value)
            yield g

    def _counters(self, rows) -> Iterator[Metric]:
        for name, doc, value in rows:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, value)
            yield c

    def _by(self, name: str, doc: str, label: str, values: Mapping[str, int], keys: tuple[str, ...],
            family=CounterMetricFamily) -> Metric:
        c = family(name, doc, labels=(*LABELS, label))
        for key in keys:
            c.add_metric([*self.labels, key], values[key])
        return c


def _count(ev: p.Event, state: PoolState, tot: Totals) -> None:
    """Add `ev` to the totals; `state` is the pool just before it."""
    hit = state.prefix_hit_tokens(ev)
    tot.events.count(ev, state.prefix_lookup(ev), hit)
    match ev:
        case p.PrefixHit() if ev.seq_id not in tot.preempted:
            tot.first_hits[ev.seq_id] = tot.first_hits.get(ev.seq_id, 0) + hit
        case p.Preempt():
            tot.preempted.add(ev.seq_id)
        case p.Append(token_ids=ids) if ids:
            tot.generation_tokens += len(ids)
            s = state.seqs[ev.seq_id]
            if not s.output_tokens and s.seq_id == s.request_id:  # a request's first token
                tot.prompt_tokens += s.prompt_tokens
                tot.prompt_tokens_cached += tot.first_hits.pop(s.seq_id, 0)
        case p.Finish():
            tot.finished[ev.reason] += 1
            tot.first_hits.pop(ev.seq_id, None)
            tot.preempted.discard(ev.seq_id)
        case p.Cow():
            tot.copy_on_write += 1
        case p.Fork():
            tot.forks += 1
        case p.Evict():
            tot.evictions += 1
        case p.StepDone():
            tot.steps += 1

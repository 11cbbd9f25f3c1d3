"""GET /metrics on a real engine server, parsed with prometheus_client's own parser, against
what the engine did: its block manager's admissions, and the events a client received."""
from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from kvscope_contract import protocol as p
from kvscope_contract.misses import REASONS
from kvscope_contract.residency import Mark, Residency
from kvscope_contract.state import PoolState
from engine.model.engine import LLMEngine
from tests.prompts import SYSTEM
from tests.protocol_client import Client

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away",
           "1, 2, 3, 4,", "Paged attention stores keys and values in blocks, so that", "Q:"]


@pytest.fixture
def serve(tiny, serve_engine):
    def make(token: str | None = None, **pool):
        engine = LLMEngine(EngineConfig(model="tiny", pool=p.PoolConfig(**pool)), tiny)
        admissions: list[tuple[int, int, str]] = []  # (tokens looked up, found cached, seq_id) per admission
        allocate = engine.block_manager.allocate

        def recording_allocate(seq, budget=None):
            cached = allocate(seq, budget)
            admissions.append((len(seq), cached, seq.seq_id))
            return cached

        engine.block_manager.allocate = recording_allocate
        return serve_engine(engine, token=token), admissions

    return make


def scrape(url: str, token: str | None = None) -> dict[tuple[str, str], float]:
    """{(sample name, the value of its one non-standard label or ""): value}."""
    req = urllib.request.Request(url.replace("ws://", "http://") + "metrics",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels["model_name"] == "tiny-llama" and s.labels["engine"] == "0"
            extra = [v for k, v in s.labels.items() if k not in ("model_name", "engine")]
            out[s.name, extra[0] if extra else ""] = s.value
    return out


def run_to_end(c: Client, seq_ids: list[str], scrape_each_frame=None) -> None:
    left = set(seq_ids)

    def done(m: dict) -> bool:
        if m["type"] == "events":
            left.difference_update(e["seq_id"] for e in m["events"] if e["kind"] == "finish")
            if scrape_each_frame:
                scrape_each_frame()
        return not left

    c.sync(done, timeout=120)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_counters_match_what_the_engine_did(serve, mode):
    srv, admissions = serve(block_size=4, num_device_blocks=24, num_host_blocks=48, preemption_mode=mode)
    c = Client(srv.url)
    events: list[dict] = []
    c.take = lambda m, take=c.take: (events.extend(m.get("events", [])), take(m))
    c.request(op="pause")  # everything queued first, so the abort below finds its request waiting
    seq_ids = []
    for prompt in [SYSTEM[:60] + "Hi", SYSTEM[:60] + "Hello"] + PROMPTS:
        seq_ids += c.request(op="submit", prompt=prompt, max_tokens=24, ignore_eos=True)["seq_ids"]
    seq_ids += c.request(op="submit", prompt="Tell me a story", max_tokens=12, n=2, temperature=1.0,
                         seed=5, ignore_eos=True)["seq_ids"]
    aborted = c.request(op="submit", prompt="Never mind", max_tokens=40, ignore_eos=True)["request_id"]
    c.request(op="abort", request_id=aborted)
    c.request(op="resume")
    seen: list[dict] = []
    run_to_end(c, seq_ids, lambda: seen.append(scrape(srv.url)))
    m = scrape(srv.url)

    # every scrape taken while the engine ran is consistent: counters only rise, hits <= queries
    for before, after in zip(seen, seen[1:] + [m]):
        assert all(after[k] >= v for k, v in before.items() if k[0].endswith("_total"))
    assert all(s["vllm:prefix_cache_hits_total", ""] <= s["vllm:prefix_cache_queries_total", ""] for s in seen)
    assert len(seen) > 10

    kinds = Counter(e["kind"] for e in events)
    preempts = [e for e in events if e["kind"] == "preempt"]
    assert preempts and {e["mode"] for e in preempts} == {mode}
    # the block manager's own admissions: every one counts, re-admissions after a recompute included
    assert m["vllm:prefix_cache_queries_total", ""] == sum(n for n, _, _ in admissions)
    assert m["vllm:prefix_cache_hits_total", ""] == sum(hit for _, hit, _ in admissions) == 4 * kinds["prefix_hit"] > 0
    if mode == "recompute":
        # each request once (the n=2 child forks, the aborted one never ran), plus each re-admission
        assert len(admissions) == len(seq_ids) - 1 + len(preempts)
    # every missed token has one reason (docs/misses.md); a re-admission's are `recomputed`
    misses = {r: m["kvscope_prefix_cache_miss_tokens_total", r] for r in REASONS}
    assert sum(misses.values()) == m["vllm:prefix_cache_queries_total", ""] - m["vllm:prefix_cache_hits_total", ""]
    assert misses["cold"] > 0 and misses["partial_block"] > 0 and misses["caching_off"] == misses["unknown"] == 0
    assert (misses["recomputed"] > 0) == (mode == "recompute")
    assert m["vllm:num_preemptions_total", ""] == len(preempts)
    assert m["kvscope_preemptions_total", mode] == len(preempts)
    assert m["vllm:generation_tokens_total", ""] == sum(len(e["token_ids"]) for e in events if e["kind"] == "append") \
        == 24 * 8 + 12 * 2
    added = {e["request_id"]: e["prompt_tokens"] for e in events if e["kind"] == "request_added"}
    assert m["vllm:prompt_tokens_total", ""] == sum(v for k, v in added.items() if k != aborted)
    # each request's tokens found cached at its first admission (vLLM's rule; a forked sample admitted
    # again after a recompute is no new request)
    first: dict[str, int] = {}
    for _, hit, seq_id in admissions:
        if seq_id in added:
            first.setdefault(seq_id, hit)
    assert m["vllm:prompt_tokens_cached_total", ""] == sum(first.values()) > 0
    assert m["vllm:request_success_total", "length"] == len(seq_ids) == 10
    assert m["vllm:request_success_total", "abort"] == 1 and m["vllm:request_success_total", "stop"] == 0
    assert m["kvscope_forks_total", ""] == kinds["fork"] == 1 and m["kvscope_copy_on_write_total", ""] == kinds["cow"]
    assert m["kvscope_evictions_total", ""] == kinds["evict"] and m["kvscope_engine_steps_total", ""] == kinds["step"]
    swaps = {d: [e for e in events if e["kind"] == f"swap_{d}"] for d in ("out", "in")}
    for d, evs in swaps.items():
        moved = sum(len(e.get("seq_ids") or [e["seq_id"]]) for e in evs)  # sequences: a fork group together
        assert m["kvscope_swaps_total", d] == moved == (len(preempts) if mode == "swap" else 0)
        assert m["kvscope_swapped_blocks_total", d] == sum(len(e["mapping"]) for e in evs)
    # all done: nothing held, the prefix cache still holds what it cached
    counts = c.state.counts()
    assert (m["kvscope_used_blocks", ""], m["kvscope_cached_blocks", ""], m["kvscope_free_blocks", ""]) \
        == (0, counts.cached, 24 - counts.cached) and counts.cached > 0
    assert m["vllm:kv_cache_usage_perc", ""] == 0 and m["vllm:num_requests_running", ""] == 0


RESIDENCY = {"lifetime": "vllm:kv_block_lifetime_seconds", "idle": "vllm:kv_block_idle_before_evict_seconds",
             "reuse": "vllm:kv_block_reuse_gap_seconds"}
VLLM_RESIDENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
                          300, 600, 1200, 1800]  # vLLM 0.32's kv_cache_residency buckets


def test_block_residency_histograms_count_every_block_in_seconds(serve):
    """vLLM's three residency histograms, every block counted: as many lifetimes as blocks went back
    to the free list, an idle time per eviction, a reuse gap per prefix hit (the pool starts empty),
    each in the seconds between the events that begin and end it, in vLLM's buckets."""
    srv, _ = serve(block_size=4, num_device_blocks=24, num_host_blocks=0, preemption_mode="recompute")
    c = Client(srv.url)
    for round_ in range(2):
        seq_ids = []
        for prompt in [SYSTEM[:60] + "Hi", SYSTEM[:60] + "Hello"] + PROMPTS[round_ * 3:round_ * 3 + 3]:
            seq_ids += c.request(op="submit", prompt=prompt, max_tokens=16, ignore_eos=True)["seq_ids"]
        run_to_end(c, seq_ids)
    m = scrape(srv.url)
    born = c.kinds["alloc"] + c.kinds["cow"]
    counts = c.state.counts()
    assert c.kinds["evict"] > 0 and c.kinds["prefix_hit"] > 0 and counts.cached > 0
    assert m[RESIDENCY["lifetime"] + "_count", ""] == born - counts.used - counts.cached
    assert m[RESIDENCY["idle"] + "_count", ""] == c.kinds["evict"]
    assert m[RESIDENCY["reuse"] + "_count", ""] == c.kinds["prefix_hit"]
    # the seconds: the contract's rule over the events this client saw, timed by their engine time
    seconds: dict[str, list[float]] = {k: [] for k in RESIDENCY}
    residency = Residency(lambda metric, ev, since: seconds[metric].append(ev.t - since.t))
    state = PoolState.empty(c.state.config)
    residency.start(state, Mark(0, 0.0))
    for ev in c.events:
        residency.apply(ev, state)
    for metric, name in RESIDENCY.items():
        values = seconds[metric]
        assert m[name + "_sum", ""] == pytest.approx(sum(values), abs=1e-6)
        assert sum(values) > 0 or metric == "reuse"
        for le in VLLM_RESIDENCY_BUCKETS:
            assert m[name + "_bucket", str(float(le))] == sum(v <= le for v in values), (name, le)
        assert m[name + "_bucket", "+Inf"] == len(values)


def test_gauges_match_the_pool_while_paused(serve):
    srv, _ = serve(block_size=8, num_device_blocks=64, num_host_blocks=16, max_num_seqs=3)
    c = Client(srv.url)
    c.request(op="pause")
    for i in range(5):
        c.request(op="submit", prompt=SYSTEM[:80] + "and why" * i + "?", max_tokens=30, n=1 + (i == 0),
                  temperature=0.9, seed=i, ignore_eos=True)
    c.request(op="step", count=3)
    c.until(lambda: c.kinds["step"] == 3)
    m = scrape(srv.url)
    st = c.state
    status = Counter(s.status for s in st.seqs.values())
    assert (m["vllm:num_requests_running", ""], m["vllm:num_requests_waiting", ""]) \
        == (status["running"], status["waiting"]) == (3, 3)  # r1 and its child, r2; r3..r5 wait
    # every waiting sequence waits for room (blocks or a batch slot): vLLM's "capacity"; none is deferred
    waiting = "vllm:num_requests_waiting_by_reason"
    assert (m[waiting, "capacity"], m[waiting, "deferred"]) == (3, 0)
    counts = st.counts()
    assert (m["kvscope_used_blocks", ""], m["kvscope_shared_blocks", ""], m["kvscope_cached_blocks", ""],
            m["kvscope_free_blocks", ""]) == (counts.used, counts.shared, counts.cached, counts.free)
    assert counts.shared > 0 and m["kvscope_device_blocks", ""] == 64 and m["kvscope_block_size_tokens", ""] == 8
    assert m["vllm:kv_cache_usage_perc", ""] == pytest.approx(counts.used / 64)
    held: dict[int, int] = {}  # tokens per used block: the most among its holders
    for s in st.seqs.values():
        for i, b in enumerate(s.block_table):
            held[b] = max(held.get(b, 0), min(8, max(0, s.num_tokens - i * 8)))
    assert m["kvscope_slot_utilisation", ""] == pytest.approx(sum(held.values()) / (8 * len(held)))
    assert 0.5 < m["kvscope_slot_utilisation", ""] < 1


def test_metrics_need_the_token_when_the_server_has_one(serve):
    srv, _ = serve(token="s3cret")
    with pytest.raises(urllib.error.HTTPError) as e:
        scrape(srv.url)
    assert e.value.code == 401
    assert scrape(srv.url, token="s3cret")["kvscope_device_blocks", ""] == 256


def test_the_docs_list_every_metric_the_server_serves(serve):
    srv, _ = serve()
    served = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name, _ in scrape(srv.url)}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    table = {n.removesuffix("_total") for row in doc.splitlines() if row.startswith("| `")
             for n in re.findall(r"`([a-z_:]+)(?:\{\w+\})?`", row.split(" | ")[0])}
    assert table == served
    rules = (Path(__file__).resolve().parents[2] / "docs" / "prometheus" / "alerts.yml").read_text()
    alert = re.search(r"expr: (\S+) > 0\.90", rules)  # the free-blocks alert (docs/prometheus.md)
    assert alert and alert.group(1) in served


def test_the_host_tier_counters_match_its_events(serve):
    """Issue 36: prompts that fill a small host tier (it evicts) and push a system prompt out of a
    small device pool, then that prompt again, loaded back from the tier: /metrics counts the tier's
    stores, loads and evictions as its events do, and vLLM's offload byte counters at bytes_per_block
    each."""
    srv, _ = serve(block_size=4, num_device_blocks=24, num_host_blocks=0, num_offload_blocks=24,
                   preemption_mode="recompute")
    c = Client(srv.url)
    numbers, fox = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14", "The quick brown fox jumps over the lazy dog. " * 3
    for i, prompt in enumerate([numbers, SYSTEM, fox, numbers, SYSTEM]):
        c.request(op="submit", prompt=prompt, max_tokens=4, request_id=f"q{i}")
        run_to_end(c, [f"q{i}"])
    kinds = Counter(e.__struct_config__.tag for e in c.events)
    m = scrape(srv.url)
    size = c.hello["config"]["bytes_per_block"]
    assert kinds["offload_load"] and kinds["offload_evict"]  # the tier filled, and served the system prompt
    assert [m["kvscope_host_tier_moved_blocks_total", op] for op in ("store", "load", "evict")] == [
        kinds["offload_store"], kinds["offload_load"], kinds["offload_evict"]]
    assert m["vllm:kv_offload_store_bytes_total", ""] == kinds["offload_store"] * size > 0
    assert m["vllm:kv_offload_load_bytes_total", ""] == kinds["offload_load"] * size > 0
    assert (m["kvscope_host_tier_blocks", ""], m["kvscope_host_tier_used_blocks", ""]) == (24, 24)

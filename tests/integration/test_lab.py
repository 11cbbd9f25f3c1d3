"""The lab: its event-driven run equals a step-by-step one, its counts equal the reducer's, a
recording replayed at its own config gives the recorded run's numbers, and its table equals
what the live engine (tiny model) reports for the same requests."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from kvscope_contract import protocol as p
from kvscope_contract.kinds import BLOCK_KINDS, kind_of
from kvscope_contract.lab import LabConfig, decode_report, to_csv
from engine.lab import report
from engine.lab.reference import row_from_events
from kvscope_contract.kv_groups import gemma3_groups
from engine.lab.sim import Lab
from engine.lab.workload import PRESETS, Request, Workload, from_messages, from_recording, load
from kvscope_contract.recording import Recording

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "assets" / "demo_recording.jsonl"

GEMMA3_LIKE = gemma3_groups(window=20)
CONFIGS = {  # a roomy pool, tight ones that preempt both ways, no cache, chunked prefill, a high watermark
    "roomy": LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=512)),
    "tight swap": LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=48, num_host_blocks=96)),
    "tight recompute": LabConfig(pool=p.PoolConfig(block_size=8, num_device_blocks=90, preemption_mode="recompute")),
    "no cache": LabConfig(pool=p.PoolConfig(block_size=4, num_device_blocks=300, enable_prefix_caching=False)),
    "chunked": LabConfig(pool=p.PoolConfig(block_size=32, num_device_blocks=40, max_num_seqs=6),
                         max_num_batched_tokens=96),
    "watermark": LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=80), watermark=0.2),
    "block 1": LabConfig(pool=p.PoolConfig(block_size=1, num_device_blocks=1500, num_host_blocks=600)),
    # Gemma 3's shape (5 sliding-window groups, 1 full) with a window a few blocks long
    "hybrid": LabConfig(pool=p.PoolConfig(block_size=8, num_device_blocks=1200, kv_groups=GEMMA3_LIKE)),
    "hybrid tight swap": LabConfig(pool=p.PoolConfig(block_size=8, num_device_blocks=500, num_host_blocks=400,
                                                     kv_groups=GEMMA3_LIKE)),
    "hybrid tight recompute": LabConfig(pool=p.PoolConfig(block_size=8, num_device_blocks=500,
                                                          preemption_mode="recompute", kv_groups=GEMMA3_LIKE)),
}


def stepwise(cfg: LabConfig, workload: Workload) -> tuple[Lab, p.Snapshot]:
    lab = Lab(cfg, workload, keep_events=True)
    start = lab.snapshot()
    lab.row = lab.run(fast=False)
    return lab, start


def block_events(events) -> list:
    """Every allocator decision, as data (numbering and timing aside)."""
    keep = set(BLOCK_KINDS) | {"status", "finish"}
    return [(kind_of(e), e.step, msgspec.structs.asdict(e) | {"seq": 0, "t": 0})
            for e in events if kind_of(e) in keep]


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_fast_run_decides_exactly_what_a_step_by_step_run_decides(preset, name):
    cfg, workload = CONFIGS[name], load(preset, 2)
    slow, _ = stepwise(cfg, workload)
    fast = Lab(cfg, workload, keep_events=True)
    row = fast.run(fast=True)
    assert row == slow.row  # every number, and the grid at the peak
    assert block_events(fast.log.pending) == block_events(slow.log.pending)
    assert row.steps > 0 and row.finished == workload.sequences - sum(
        r.n for r in workload.requests if r.request_id in row.rejected)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_counts_kept_from_events_equal_the_reducer_at_every_step(preset, name):
    cfg = CONFIGS[name]
    lab, start = stepwise(cfg, load(preset, 2))
    ref = row_from_events(cfg, start, lab.log.pending)
    mine = msgspec.structs.replace(lab.row, peak=None, rejected=[])
    assert mine == ref


@pytest.mark.parametrize("kind", ["", "hybrid "])
def test_the_tight_configs_do_preempt_both_ways(kind):
    rows = {name: stepwise(CONFIGS[kind + name], load("chat", 2))[0].row for name in ("tight swap", "tight recompute")}
    assert rows["tight swap"].swap_outs == rows["tight swap"].preemptions > 0 and rows["tight swap"].swapped_blocks > 0
    assert rows["tight recompute"].recomputes == rows["tight recompute"].preemptions > 0
    # a re-admission after a recompute looks its tokens up again: vLLM's counters leave it out
    swap, rec = rows["tight swap"], rows["tight recompute"]
    assert (swap.first_looked_up_tokens, swap.first_hit_tokens) == (swap.looked_up_tokens, swap.hit_tokens)
    assert rec.first_looked_up_tokens < rec.looked_up_tokens and rec.first_hit_tokens <= rec.hit_tokens
    # each token is computed once (the last sampled one never), less what the cache served; swap
    # pays in blocks copied, recompute in tokens computed again
    w = load("chat", 2)
    once = lambda row: w.tokens - w.sequences - row.hit_tokens
    assert rows["tight swap"].computed_tokens == once(rows["tight swap"])
    assert rows["tight recompute"].computed_tokens > once(rows["tight recompute"])


def test_a_hybrid_pools_windows_free_blocks_and_its_hits_need_every_group():
    lab, _ = stepwise(CONFIGS["hybrid"], load("chat", 2))
    kinds = Counter(kind_of(e) for e in lab.log.pending)
    assert kinds["window_free"] > 0 and kinds["prefix_hit"] > 0
    hits = [e for e in lab.log.pending if isinstance(e, p.PrefixHit)]
    assert {e.kv_group for e in hits} == set(range(6))  # every group serves its part of a hit
    assert lab.row.hit_tokens % 8 == 0 and 0 < lab.row.hit_rate < 1


def test_smaller_blocks_use_slots_better_but_need_more_table_entries_on_the_mixed_preset():
    workload = load("mixed")
    base = LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=256))
    rows = report.run(workload, report.configs(base, block_sizes=[4, 8, 16, 32, 64])).rows
    assert [r.config.pool.num_device_blocks for r in rows] == [1024, 512, 256, 128, 64]  # the same memory
    util = [r.slot_util for r in rows]
    entries = [r.mean_entries for r in rows]
    assert util == sorted(util, reverse=True) and util[0] > 0.97 and util[-1] < 0.85
    assert entries == sorted(entries, reverse=True) and entries[0] > 10 * entries[-1]
    assert all(r.finished == workload.sequences and r.preemptions == 0 for r in rows)


def test_a_recording_replayed_at_its_own_config_gives_the_recorded_numbers():
    """The demo recording (SmolLM2, the four scenarios, preemptions included) has no prompt token
    ids: its prompts are rebuilt from the block hashes it shows, and the run comes out the same."""
    rec = Recording(DEMO)
    events = [e for batch in rec.batches for e in batch]
    workload = from_recording(DEMO)
    assert any("rebuilt from block hashes" in n for n in workload.notes)
    cfg = LabConfig(pool=rec.start.config)
    recorded = row_from_events(cfg, rec.start, events)
    for fast in (False, True):
        row = Lab(cfg, workload).run(fast=fast)
        assert msgspec.structs.replace(row, peak=None) == recorded
    assert recorded.hit_tokens > 0 and recorded.swap_outs > 0  # the comparison covers hits and swaps



LIVE = {"tight swap": CONFIGS["tight swap"], "chunked": CONFIGS["chunked"],
        "tight recompute": LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=40,
                                                       preemption_mode="recompute")),
        "no cache": LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=64, enable_prefix_caching=False))}


@pytest.mark.parametrize("name", list(LIVE))
def test_the_lab_table_equals_the_live_engines_for_the_same_requests(tiny, name):
    """The live engine (tiny model, real forward passes) runs the preset's prompts; the lab replays
    what it sampled, from its events, under the same config: the same decisions, the same table."""
    from engine.config import EngineConfig
    from engine.model.engine import LLMEngine
    from engine.core.sequence import SamplingParams

    cfg = LIVE[name]
    short = lambda reqs: [Request(r.request_id, r.arrival, r.prompt, [o[:16] for o in r.outputs], 16) for r in reqs]
    workload = Workload("live", short(load("parallel").requests[:2] + load("chat").requests[:6]))
    engine = LLMEngine(EngineConfig(model="tiny", pool=cfg.pool, watermark=cfg.watermark,
                                    max_num_batched_tokens=cfg.max_num_batched_tokens), tiny)
    start = engine.snapshot()
    pending = sorted(workload.requests, key=lambda r: r.arrival)
    while pending or engine.has_unfinished():
        while pending and (pending[0].arrival <= engine.log.step or not engine.has_unfinished()):
            r = pending.pop(0)
            engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, n=r.n, temperature=1.0,
                                                        seed=7, ignore_eos=True), request_id=r.request_id)
        engine.step()
    live = engine.drain_events()
    replayed = from_messages("live", start, live)  # prompts from the events, outputs as sampled
    assert not replayed.notes and len(replayed.requests) == len(workload.requests)
    lab_cfg = msgspec.structs.replace(cfg, pool=engine.pool)
    truth = row_from_events(lab_cfg, start, live)
    slow = Lab(lab_cfg, replayed, keep_events=True)
    assert msgspec.structs.replace(slow.run(fast=False), peak=None) == truth
    assert block_events(slow.log.pending) == block_events(live)
    assert msgspec.structs.replace(Lab(lab_cfg, replayed).run(), peak=None) == truth
    assert (truth.preemptions > 0) == name.startswith("tight")


def test_a_request_that_never_fits_is_reported_not_fatal():
    big = Request("huge", 0, list(range(600)), [[1] * 10], 10)
    workload = Workload("one too big", [big] + load("mixed").requests)
    row = Lab(LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=32)), workload).run()
    assert row.rejected == ["huge"] and row.finished == 8


def test_configs_keep_memory_when_only_the_block_size_changes():
    base = LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=256))
    cfgs = report.configs(base, block_sizes=[8, 32], caching=[True, False], preemption=["swap", "recompute"])
    assert len(cfgs) == 8
    assert {(c.pool.block_size, c.pool.num_device_blocks) for c in cfgs} == {(8, 512), (32, 128)}
    assert report.configs(base, block_sizes=[8], blocks=[100])[0].pool.num_device_blocks == 100


def test_the_cli_prints_the_table_and_writes_csv_and_json(tmp_path):
    out = tmp_path / "lab.csv"
    run = lambda *a: subprocess.run([sys.executable, "-m", "engine.lab", *a], cwd=ROOT, capture_output=True,
                                    text=True, timeout=120)
    text = run("mixed", "--block-sizes", "4,64", "--csv", str(out), "--grid")
    assert text.returncode == 0, text.stderr
    assert "1024×4 swap" in text.stdout and "64×64 swap" in text.stdout and "tokens/s" in text.stdout
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["block_size"] for r in rows] == ["4", "64"] and float(rows[0]["slot_util"]) > float(rows[1]["slot_util"])
    js = run(str(DEMO), "--blocks", "128", "--json")
    rep = decode_report(js.stdout)
    assert rep.rows[0].config.pool.num_device_blocks == 128 and rep.rows[0].peak is not None
    assert len(rep.rows[0].peak.states) == 128 and to_csv(rep).count("\n") == 2
    bad = run("nonsense")
    assert bad.returncode == 2 and "neither a preset" in bad.stderr
    assert run("mixed", "--block-sizes", "3").returncode == 2
    assert json.loads(js.stdout)["workload"] == DEMO.name

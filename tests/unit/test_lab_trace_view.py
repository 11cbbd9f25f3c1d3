"""The Lab's Trace workload without a browser: the chart, the table and the CSV drawn from a sweep
(kvscope_contract.lab.TraceSweep), the Mooncake traces offered only where they are, and the child
that runs the sweep (app/link/lab_run.py): its progress lines, and a bad line's message as the error."""
from __future__ import annotations

import csv
import io
import json

import pytest

from kvscope_contract.lab import TRACE_REASONS, TracePoint, TraceSweep
from app.link.lab_run import run_sweep, sweep_args
from app.modes import lab_trace_view as view


def a_sweep() -> TraceSweep:
    s = TraceSweep(trace="/x/chats.jsonl", requests=3, prompt_tokens=3000, output_tokens=30, block_size=512,
                   one_at_a_time=False, step_ms=50.0, max_num_batched_tokens=8192, model="SmolLM2-135M",
                   bytes_per_token=23040, ceiling_hit_tokens=1024, unlimited_blocks=40)
    for blocks, hits in ((10, (512, 1024)), (40, (1024, 1024))):
        for policy, hit in zip(("lru", "opt"), hits):
            missed = dict.fromkeys(TRACE_REASONS, 0) | {"cold": 1800, "partial_block": 176, "evicted": 1024 - hit}
            s.points.append(TracePoint(policy=policy, blocks=blocks, tokens=blocks * 512, bytes=blocks * 512 * 23040,
                                       hit_tokens=hit, looked_up_tokens=3000, missed=missed, evictions=7 - hit // 512,
                                       preemptions=1, rejected=0, finished=3, steps=99))
    return s


def layers(spec: dict) -> dict[str, dict]:
    return {layer["mark"]["type"]: layer for layer in spec["layer"]}


def test_the_chart_draws_each_point_with_its_counts_and_the_ceiling_as_a_rule():
    s = a_sweep()
    spec = view.chart(s)
    marks = layers(spec)
    assert set(marks) == {"line", "point", "rule", "text"}
    rows = marks["point"]["data"]["values"]
    assert [(r["policy"], r["blocks"], r["hit rate"]) for r in rows] == \
        [(pt.policy, pt.blocks, pt.hit_rate) for pt in s.points]
    assert rows[0]["description"] == "lru at 10 blocks: 512 of 3000 tokens hit, 6 evictions"
    assert rows[0]["bytes"] == "112 MiB" and rows[2]["bytes"] == "450 MiB"
    x = marks["point"]["encoding"]["x"]
    assert x["scale"]["type"] == "log" and x["axis"]["values"] == [10, 40]  # few capacities: each labelled
    assert "' tokens'" in x["axis"]["labelExpr"] and "GiB" in x["axis"]["labelExpr"]  # blocks, tokens, bytes
    assert marks["rule"]["data"]["values"][0]["ceiling"] == pytest.approx(1024 / 3000)
    assert "ceiling 34.1%" in marks["text"]["data"]["values"][0]["label"]
    assert spec["usermeta"] == {"embedOptions": {"renderer": "svg"}}  # points in the DOM, with their descriptions


def test_the_table_and_the_csv_hold_every_point_with_its_misses_by_reason():
    s = a_sweep()
    row = view.point_row(s, s.points[0])
    assert row["tokens"] == 5120 and row["KV bytes"] == "112 MiB"
    assert row["hit rate"] == pytest.approx(512 / 3000) and row["of ceiling"] == pytest.approx(0.5)
    assert row["evicted"] == pytest.approx(512 / 3000) and row["cold"] == pytest.approx(0.6)
    table = list(csv.DictReader(io.StringIO(view.to_csv(s))))
    assert [(r["policy"], int(r["blocks"]), int(r["bytes"])) for r in table] == \
        [(pt.policy, pt.blocks, pt.bytes) for pt in s.points]
    assert {r: int(table[0][f"missed_{r}"]) for r in TRACE_REASONS} == s.points[0].missed


def test_the_mooncake_traces_are_offered_where_they_are_and_the_bundled_slice_everywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(view, "MOONCAKE_DIRS", (tmp_path / "nowhere", tmp_path / "mooncake"))
    assert view.mooncake_traces() == view.BUNDLED
    (bundled,) = view.BUNDLED.values()
    assert bundled.is_file() and (bundled.parent / "LICENSE-APACHE").is_file()
    (tmp_path / "mooncake").mkdir()
    for name in ("conversation_trace.jsonl", "synthetic_trace.jsonl"):
        (tmp_path / "mooncake" / name).write_text("")
    assert list(view.mooncake_traces()) == ["Mooncake conversation", "Mooncake synthetic", *view.BUNDLED]


def test_the_sweeps_command_line():
    assert sweep_args("t.jsonl", ["lru", "opt"], [60, 120], requests=200, model="smollm2") == [
        "trace:t.jsonl", "--policy", "lru,opt", "--sweep", "60,120", "--requests", "200", "--model", "smollm2"]
    assert sweep_args("t.jsonl", ["lfu"], None, block_size=64, one_at_a_time=True, bytes_per_token=327680) == [
        "trace:t.jsonl", "--policy", "lfu", "--block-size", "64", "--one-at-a-time", "--bytes-per-token", "327680"]


def test_the_child_reports_each_replay_and_a_bad_lines_message(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    lines = [{"timestamp": i, "input_length": 1100, "output_length": 4, "hash_ids": [0, 1, 2 + i]} for i in range(4)]
    good.write_text("".join(json.dumps(x) + "\n" for x in lines))
    lines[1]["hash_ids"] = [0, 1]
    bad.write_text("".join(json.dumps(x) + "\n" for x in lines))
    said: list[str] = []
    s = run_sweep(good, ["lru", "opt"], [8, 16], progress=said.append)
    assert [(pt.policy, pt.blocks) for pt in s.points] == [("lru", 8), ("opt", 8), ("lru", 16), ("opt", 16)]
    assert [line.split(":")[0] for line in said] == ["lru at 8 blocks", "opt at 8 blocks", "lru at 16 blocks",
                                                     "opt at 16 blocks"]
    with pytest.raises(RuntimeError, match=f"{bad}:2: 2 hash_ids for input_length 1100"):
        run_sweep(bad, ["lru"], [8])


def test_a_sweep_with_a_host_tier_draws_each_policy_twice_device_only_and_with_the_tier(tmp_path):
    """The Lab's host tier (issue 36): the child sweeps each point with and without it; the chart
    draws the tier's points dashed at device + host hits, their exact counts in their descriptions;
    the table and the CSV say the tier and its hits."""
    assert sweep_args("t.jsonl", ["lru"], [8], host_blocks=64)[-2:] == ["--host-blocks", "0,64"]
    trace = tmp_path / "t.jsonl"  # a shared prefix, others that push it out of 7 blocks, then it again
    rows = [[0, 1, 2], [10, 11, 12], [20, 21, 22], [0, 1, 3]]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1536, "output_length": 2, "hash_ids": ids})
                             + "\n" for i, ids in enumerate(rows)))
    s = run_sweep(trace, ["lru"], [7], one_at_a_time=True, host_blocks=64)
    alone, tier = sorted(s.points, key=lambda pt: pt.host_blocks)
    assert (alone.host_blocks, tier.host_blocks) == (0, 64) and alone.hit_tokens == tier.hit_tokens == 0
    assert tier.host_hit_tokens == 2 * 512 and tier.tier_hit_rate > alone.tier_hit_rate == 0
    spec = view.chart(s)
    points = layers(spec)["point"]
    drawn = {r["tier"]: (r["hit rate"], r["device hit rate"], r["description"]) for r in points["data"]["values"]}
    assert drawn["device only"][:2] == (0, 0)
    assert drawn["device + host tier"][:2] == (tier.tier_hit_rate, 0)
    assert drawn["device + host tier"][2].endswith("a host tier of 64: 1024 more from it")
    assert points["encoding"]["strokeDash"]["field"] == "tier" and points["encoding"]["detail"]["field"] == "series"
    row = view.point_row(s, tier)
    assert row["host tier"] == 64 and row["device + host"] == tier.tier_hit_rate and row["hit rate"] == 0
    table = list(csv.DictReader(io.StringIO(view.to_csv(s))))
    assert sorted((int(r["host_blocks"]), int(r["host_hit_tokens"])) for r in table) == [(0, 0), (64, 1024)]
    assert "strokeDash" not in layers(view.chart(a_sweep()))["point"]["encoding"]  # no tier: drawn as before

"""bench.throughput's machinery on the tiny model: interleaved rounds, the report's medians and
ratios, and the greedy agreement it prints (vLLM's side is exercised by running the bench)."""
from __future__ import annotations

from bench import throughput as tp


def test_rounds_interleave_and_the_report_reads_right(tiny):
    jobs = [j for j in tp.make_jobs(tiny.tokenizer, 4, 6) if j.name in ("batch 4", "TTFT 256")]
    sides = [tp.KVScopeSide(tiny), tp.TransformersSide(tiny)]
    said = []
    res = tp.run_rounds(jobs, sides, rounds=2, say=said.append)
    ran = [line.split(" | ")[1] for line in said]  # "  batch 4 | kvscope | 123.4 tok/s"
    assert ran == ["kvscope", "transformers", "transformers", "kvscope"] * 2  # A B, then B A, per job
    assert all(len(v) == 2 for v in res.seconds.values())
    text = tp.report(jobs, sides, res, "float32")
    assert text.count("\n") == 1 + len(jobs) and "kvscope / transformers" in text
    # fp32 greedy: both sides produce the same tokens
    assert "batch 4 vs transformers: 4/4 identical" in tp.agreement(jobs, sides, res)


def test_ratio_is_how_many_times_faster_kvscope_is():
    class Side:
        def __init__(self, name):
            self.name = name
    jobs = [tp.Job("batch 2", [[1, 2], [3]], 10, "tok/s"), tp.Job("TTFT 2", [[1, 2]], 1, "ms")]
    res = tp.Results()
    for job in jobs:
        for ours, theirs in ((1.0, 3.0), (2.0, 4.0), (1.0, 2.5)):
            res.add(job, "kvscope", ours, [[0]])
            res.add(job, "other", theirs, [[0]])
    rows = tp.report(jobs, [Side("kvscope"), Side("other")], res, "bf16").splitlines()[2:]
    assert "20.0 (10.0..20.0)" in rows[0]           # 20 tokens in 1, 2, 1 s: median 20 tok/s
    assert "**2.50x** (2.00..3.00)" in rows[0]      # per-round time ratios 3, 2, 2.5
    assert "1000.0 (1000.0..2000.0)" in rows[1] and "**2.50x**" in rows[1]  # TTFT in ms, same ratio

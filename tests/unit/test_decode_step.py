"""A decode step's layers in one call of the C++ kernels (engine/model/decode_step.py) computes the
bits the ops compute one by one, for each kernel variant this CPU runs (avx512, avx2, generic),
on Llama's and Gemma 3's layers, each dtype and both GEMV layouts; the runner takes it for decode
steps of up to four rows and not for prefill; bad arguments are refused with a clear error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.core.sequence import SamplingParams
from engine.model import decode_step, model_runner
from engine.model.model_loader import load_model
from kernels import cpu_build, linear
from tests.tiny_engine import hf_greedy, make

ok, why = cpu_build.supported()
pytestmark = pytest.mark.skipif(not ok, reason=f"C++ CPU kernels cannot be built here: {why}")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
           "Paged attention stores the keys and values of every token in fixed-size blocks that can live anywhere "
           "in one pool; a sliding-window layer only ever reads the blocks of its last few tokens."]


def both_paths(runner, monkeypatch) -> dict[str, int]:
    """Run every forward of `runner` both ways and assert the logits are the same bits; counts the
    steps that ran in one call and the ones that did not."""
    forward, takes, seen = runner.forward, decode_step.takes, {"one call": 0, "ops": 0}

    def checked(input_ids, positions, metas, logits_rows):
        one_call = takes(input_ids, metas) and decode_step.layer_arguments(runner.layers) is not None
        seen["one call" if one_call else "ops"] += 1
        fused = forward(input_ids, positions, metas, logits_rows)  # the ops store the same K/V again
        monkeypatch.setattr(decode_step, "takes", lambda *_: False)
        ops = forward(input_ids, positions, metas, logits_rows)
        monkeypatch.setattr(decode_step, "takes", takes)
        assert torch.equal(fused, ops)
        return fused
    monkeypatch.setattr(runner, "forward", checked)
    return seen


@pytest.mark.parametrize("spec", ["tiny", "tiny-gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float32+bfloat16"])
@pytest.mark.parametrize("layout", linear.GEMV_LAYOUTS)
def test_a_decode_step_in_one_call_computes_the_bits_of_the_ops(isa, monkeypatch, spec, dtype, layout):
    """Four prompts decoding together (Gemma's window of 32 passed by the long one), then one alone:
    each decode step run both ways gives the same logits, bit for bit."""
    if layout == "packed" and dtype == "float32":
        pytest.skip("packed is a layout of bf16 operands")
    loaded = load_model(spec, device="cpu", dtype=dtype)
    engine = make(loaded, block_size=8)
    runner = engine.runner
    for w in runner.layers:
        for lin in (w.qkv, w.o, w.gate_up, w.down):
            linear.set_gemv(lin, layout)
    seen = both_paths(runner, monkeypatch)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    batch = engine.generate(PROMPTS, params)
    alone = engine.generate(PROMPTS[:1], params)
    assert [o.token_ids for (o,) in alone] == [batch[0][0].token_ids]
    assert seen["one call"] >= 2 * 39 and seen["ops"] >= 1  # every decode step in one call, prefill not


def test_greedy_decoding_in_one_call_matches_transformers(isa):
    """fp32 Llama, every layer's linear layers as GEMVs (as on a real model): the engine, decoding
    in one call of the kernels, is token-identical to transformers' generate()."""
    loaded = load_model("tiny", device="cpu", dtype="float32")
    engine = make(loaded, block_size=8)
    assert decode_step.layer_arguments(engine.runner.layers) is not None
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for (out,) in engine.generate(PROMPTS[:3], params):
        assert out.token_ids == hf_greedy(loaded, out.prompt_token_ids, params.max_tokens)


def test_a_fresh_process_decodes_gemma_at_batch_1_as_transformers_does():
    """As a user's process runs it, torch's thread count never set: the step's attention cuts the one
    KV head's query heads across the threads, which must agree on how (torch's count, read on a worker
    thread, once split the loop differently: wrong tokens, then a corrupted heap)."""
    script = ("import engine\n"
              "from engine.core.sequence import SamplingParams\n"
              "from engine.model.model_loader import load_model\n"
              "from tests.tiny_engine import hf_greedy, make\n"
              "loaded = load_model('tiny-gemma3', device='cpu', dtype='float32')\n"
              "prompt = list(range(5, 205))\n"
              "(out,), = make(loaded).generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))\n"
              "assert out.token_ids == hf_greedy(loaded, prompt, 20), (out.token_ids, hf_greedy(loaded, prompt, 20))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_layers_run_as_gemvs_where_a_step_runs_in_one_call(monkeypatch):
    """choose_gemv may put a kind of layer on the backend's GEMM only where decode_step cannot run
    it: with the kernels loaded, every kind of layer is a GEMV, the lm_head may be either."""
    offered = []
    monkeypatch.setattr(model_runner, "choose_gemv", lambda lins, gemm=True: offered.append(gemm) or "rows")
    monkeypatch.setattr(model_runner, "_PREPARED", type(model_runner._PREPARED)())
    make(load_model("tiny", device="cpu", dtype="float32"))
    assert offered == ([False] * 4 if cpu_build.loaded() else [True] * 4) + [True]


def test_bad_arguments_are_refused_clearly(isa):
    x, residual = torch.zeros(1, 64), torch.zeros(1, 64)
    ops = cpu_build.ops()
    with pytest.raises(RuntimeError, match="per layer 14 weights"):
        ops.decode_step(x, residual, [None] * 13, [0] * 4, [x, x], [x, x], [], [], [0], [0], [1.0, 1e-6], 1, False)
    with pytest.raises(RuntimeError, match=r"M <= 4"):
        big = torch.zeros(5, 64)
        ops.decode_step(big, big, [None] * 14, [0] * 4, [x, x], [x, x], [], [], [0], [0], [1.0, 1e-6], 1, False)

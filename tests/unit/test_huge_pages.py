"""The GEMVs' operands in 2 MB pages (kernels/huge_pages.py): the same values, one copy of each,
Linux asked for huge pages where it has them, and the ordinary pages elsewhere tested too."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from bench.huge_pages import compare, ordinary_pages
from engine.core.sequence import SamplingParams
from engine.model.model_loader import load_model
from engine.model import model_runner
from engine.model.model_runner import step_linears
from kernels import cpu_build, linear
from kernels.huge_pages import HUGE_PAGE, huge_page_copies
from tests.tiny_engine import hf_greedy, make

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list[str]:
    """The flags of the mapping that holds `address` (/proc/self/smaps: `hg` is MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
            lo, hi = (int(a, 16) for a in line.split(" ", 1)[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("advise", [True, False], ids=["huge pages", "ordinary pages"])
def test_the_copies_hold_the_same_values_one_after_another(advise):
    tensors = [torch.randn(300, 640), torch.randn(3, 5).to(torch.bfloat16), torch.empty(0, 8),
               torch.arange(7), torch.randn(64, 64).t()]  # the last not contiguous; its copy is
    copies = huge_page_copies(tensors, advise=advise)
    assert copies[0].data_ptr() % HUGE_PAGE == 0 and all(c.data_ptr() % 64 == 0 for c in copies)
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.is_contiguous()
    copies[0][0, 0] = 7.0  # a copy, not a view of the original
    assert tensors[0][0, 0] != 7.0
    assert huge_page_copies([]) == []


def test_the_mapping_lives_as_long_as_a_copy_does():
    first, second = huge_page_copies([torch.ones(1 << 20), torch.full((1 << 20,), 2.0)])
    del first
    gc.collect()
    assert second.sum().item() == 2.0 * (1 << 20)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(),
                    reason="transparent huge pages are Linux's")
def test_linux_is_asked_for_huge_pages_only_where_advised():
    """Whether the kernel then gives 2 MB pages is its call (memory may be fragmented); that it was
    asked is the mapping's `hg` flag."""
    advised, = huge_page_copies([torch.ones(4 * HUGE_PAGE // 4)])
    plain, = huge_page_copies([torch.ones(4 * HUGE_PAGE // 4)], advise=False)
    if "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    assert "hg" in vm_flags(advised.data_ptr()) and "hg" not in vm_flags(plain.data_ptr())


def test_the_engine_streams_its_weights_from_one_copy_in_huge_pages(isa, monkeypatch):
    """Each GEMV operand is in the advised mapping; where it is a weight of the model itself (o, down,
    the lm_head tied to the embeddings) the model's parameter is that copy, so no second copy stays;
    and decoding, by the engine and by transformers on the moved parameters, is unchanged."""
    # every Linear a GEMV: the tiny lm_head may otherwise time faster on the GEMM, and stay put
    monkeypatch.setattr(model_runner, "choose_gemv", lambda lins, gemm=True: linear.choose_gemv(lins, gemm=False))
    loaded = load_model("tiny-gemma3", device="cpu", dtype="float32")
    engine = make(loaded)
    model, runner = loaded.model, engine.runner
    lins = step_linears(runner.layers, runner.lm_head)
    assert all(lin.gemv for lin in lins)
    if sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text():
        assert all("hg" in vm_flags(lin.plain.data_ptr()) for lin in lins)
    first = model.model.layers[0]
    assert first.self_attn.o_proj.weight.data_ptr() == runner.layers[0].o.plain.data_ptr()
    assert first.mlp.down_proj.weight.data_ptr() == runner.layers[0].down.plain.data_ptr()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == runner.lm_head.plain.data_ptr()
    prompt = list(range(5, 60))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    (out,), = engine.generate([prompt], params)
    assert out.token_ids == hf_greedy(loaded, prompt, params.max_tokens)


def test_without_the_kernels_nothing_moves(monkeypatch):
    """No GEMV (the kernels not built, a GPU): the model's weights stay where they were loaded."""
    monkeypatch.setattr(cpu_build, "loaded", lambda: False)
    monkeypatch.setattr(linear, "_choice", {})  # choose_backend's, per process
    loaded = load_model("tiny", device="cpu", dtype="float32")
    before = {name: p.data_ptr() for name, p in loaded.model.named_parameters()}
    make(loaded)
    assert {name: p.data_ptr() for name, p in loaded.model.named_parameters()} == before


def test_bench_huge_pages_other_side_reads_the_same_values_from_torchs_own_memory(isa):
    """bench.huge_pages compares the engine's operands in 2 MB pages with copies in torch's memory:
    the other side gets each GEMV's way from the first, its operand out of the advised mapping, the
    same bits out."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(640, 96, bias=False).to(torch.bfloat16) for _ in range(3)]
    chosen, other = ([linear.Linear([layer], "torch", gemv=True) for layer in layers] for _ in range(2))
    for lin, way in zip(chosen, ["rows", "packed", "serial"]):
        linear.set_gemv(lin, way)
    linear.into_huge_pages(chosen)
    linear.into_huge_pages(other)
    ordinary_pages(chosen, other)
    assert [linear.gemv_way(lin) for lin in other] == ["rows", "packed", "serial"]
    if sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text():
        assert all("hg" in vm_flags(a.plain.data_ptr()) and "hg" not in vm_flags(b.plain.data_ptr())
                   for a, b in zip(chosen, other))
    x = torch.randn(1, 640, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert all(torch.equal(a(x), b(x)) for a, b in zip(chosen, other))


def test_bench_huge_pages_decodes_the_same_tokens_on_both_sides(isa):
    row = compare("tiny", "float32", rounds=1)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "tiny, float32" and cells[-1] == "True" and "x** (" in cells[4], row

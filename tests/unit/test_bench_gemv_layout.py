"""bench/gemv_layout.py switches a Linear's GEMV weights between layouts without changing a value."""
from __future__ import annotations

import pytest
import torch

from bench.gemv_layout import mirror, other_layout
from kernels import cpu_build, linear

ok, why = cpu_build.supported()
pytestmark = pytest.mark.skipif(not ok, reason=f"C++ CPU kernels cannot be built here: {why}")


@pytest.mark.parametrize("dtype,gemv_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)],
                         ids=["bfloat16", "float32+bfloat16"])
def test_the_other_layout_gives_the_same_outputs_and_switches_back(isa, dtype, gemv_dtype):
    torch.manual_seed(0)
    lin = linear.Linear([torch.nn.Linear(640, 96, bias=False).to(dtype)], "torch", gemv=True, gemv_dtype=gemv_dtype)
    x = torch.randn(1, 640, dtype=dtype)
    chosen, weights = lin(x), lin.plain.clone()
    other_layout(lin)
    assert lin.packed is True and not torch.equal(lin.plain, weights)  # a Linear starts in rows
    assert torch.equal(lin(x), chosen)  # the same sums in the same order, from the other layout
    other_layout(lin)
    assert lin.packed is False and torch.equal(lin.plain, weights)


def test_the_other_side_gets_each_gemv_of_the_chosen_side_in_the_other_layout(isa):
    """bench.gemv_layout loads the model twice, and the second load may choose otherwise: mirror
    sets it from the first, kind by kind; a Linear left to the GEMM stays there."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(640, 96, bias=False).to(torch.bfloat16) for _ in range(3)]
    make = lambda: [linear.Linear([layer], "torch", gemv=True) for layer in layers]  # noqa: E731
    chosen, other = make(), make()
    for lin, way in zip(chosen, ["rows", "packed", "off"]):
        linear.set_gemv(lin, way)
    linear.set_gemv(other[0], "packed")  # the second load's own choice, which mirror overrides
    mirror(chosen, other)
    assert [linear.gemv_way(lin) for lin in other] == ["packed", "rows", "off"]
    x = torch.randn(1, 640, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert all(torch.equal(a(x), b(x)) for a, b in zip(chosen, other))

"""bench/gemv_layout.py gives the other side's GEMVs one layout without changing a value."""
from __future__ import annotations

import pytest
import torch

from bench.gemv_layout import mirror
from kernels import cpu_build, linear

ok, why = cpu_build.supported()
pytestmark = pytest.mark.skipif(not ok, reason=f"C++ CPU kernels cannot be built here: {why}")


@pytest.mark.parametrize("layout", linear.GEMV_LAYOUTS)
def test_the_other_side_gets_each_gemv_of_the_chosen_side_in_one_layout(isa, layout):
    """bench.gemv_layout loads the model twice, and the second load may choose otherwise: mirror
    sets it from the first, kind by kind, every GEMV in `layout`; a Linear left to the GEMM stays
    there; the outputs are the same bits (every layout sums in the same order)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(640, 96, bias=False).to(torch.bfloat16) for _ in range(3)]
    make = lambda: [linear.Linear([layer], "torch", gemv=True) for layer in layers]  # noqa: E731
    chosen, other = make(), make()
    for lin, way in zip(chosen, ["rows", "packed", "off"]):
        linear.set_gemv(lin, way)
    linear.set_gemv(other[2], "serial")  # the second load's own choice, which mirror overrides
    mirror(chosen, other, layout)
    assert [linear.gemv_way(lin) for lin in other] == [layout, layout, "off"]
    x = torch.randn(1, 640, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert all(torch.equal(a(x), b(x)) for a, b in zip(chosen, other))

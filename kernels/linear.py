"""Linear layers for the engine's step: fused weights, and on the CPU the fastest GEMM backend.

On the CPU, torch's `F.linear` sends fp32 to MKL's sgemm (half speed on this project's AMD CPUs)
and re-lays out bf16 weights for oneDNN on every call. oneDNN with the weight reordered once
(`mkldnn._reorder_linear_weight`, the layout inductor's freezing pass uses) was 1.3-3x faster
here at 1 to 2,048 rows (docs/benchmarks.md). Those ops are private, so `choose_backend` checks
once per process, dtype and shapes that they exist and time faster than `F.linear` on the model's own
shapes (a few ms), and otherwise keeps `F.linear`.

At one to a few rows (decode at small batch) a linear layer is a stream of its weights, and the
C++ `kvscope.gemv` streams them faster than either on most CPUs measured (docs/benchmarks.md).
It can stream a bf16 copy of fp32 weights (`gemv_dtype`): half the bytes, fp32 arithmetic on
weights rounded to bf16; the GEMMs keep the fp32 weights, so prefill and larger batches stay
exact fp32 (engine/model/model_loader.py decides where that is the default). The GEMV reads its
operand in one of three layouts (GEMV_LAYOUTS), which give the same sums in the same order: rows
as they are, several side by side; serial, the same rows one after another; or packed by
`gemv_pack` into one sequential stream (bf16 operands).

Which way streams fastest depends on the machine and the shape (packed was 1.3-1.8x the rows on
one of this project's CPUs and 0.7-0.9x on another, where serial was 1.1-1.6x; the GEMV against
oneDNN flipped between loads when timed on one matrix in cache), so `choose_gemv` times the ways
where the model is loaded, per kind of layer, calling every layer's weights in turn as a decode
step does; then `into_huge_pages` moves the operands, each in its chosen layout, into 2 MB pages.
"""
from __future__ import annotations

from collections.abc import Iterable
from time import perf_counter

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_build
from kernels.huge_pages import huge_page_copies, return_freed_memory

PACK_ROWS = 32  # oneDNN's layout hint: the decode batch; the same layout was best up to 2,048 rows
GEMV_ROWS = 4  # kvscope.gemv takes up to this many rows
# kvscope.gemv's layout argument, by index (GemvLayout in kernels/cpu/kvscope_cpu.cpp)
GEMV_LAYOUTS = ("rows", "packed", "serial")
# packed is chosen only this much faster than the other ways: it is a copy, and SmolLM2's small
# kinds (a pass of ~1 ms) timed within a few % of the rows, flipping between loads (bench.gemv_layout)
PACKED_MARGIN = 1.05
_choice: dict[tuple, tuple[str, bool]] = {}


def _onednn_ops() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


class Linear:
    """y = x W^T (+ b) for one weight, or several concatenated along the output (q|k|v, gate|up)."""

    def __init__(self, layers: list[torch.nn.Linear], backend: str = "torch", gemv: bool = False,
                 gemv_dtype: torch.dtype | None = None):
        """backend: 'torch' or 'onednn' (packed weights); gemv: kvscope.gemv for up to GEMV_ROWS rows,
        on a copy of the weights in `gemv_dtype` (none in their own dtype), read in rows until
        choose_gemv chooses its layout."""
        weights = [layer.weight.detach() for layer in layers]
        biases = [layer.bias for layer in layers]
        self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.dtype, self.in_features = self.weight.dtype, self.weight.shape[1]  # x's
        # the GEMV's operand, kept beside oneDNN's packed copy
        self.plain = None if not gemv else self.weight.to(gemv_dtype or self.weight.dtype)
        self.rows = self.plain if self.plain is self.weight else None  # the weight itself: rows for no copy
        self.layout = 0  # the GEMV operand's, an index into GEMV_LAYOUTS
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        self.out_features = self.weight.shape[0]
        self.backend, self.gemv = backend, gemv
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)

    def __call__(self, x: Tensor) -> Tensor:
        if self.gemv and x.shape[0] <= GEMV_ROWS:
            out = x.new_empty(x.shape[0], self.out_features)
            cpu_build.ops().gemv(out, x, self.plain, self.bias, self.layout)
            return out
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def relayout(lin: Linear, layout: str) -> None:
    """Have a Linear's GEMV read its operand in `layout` (GEMV_LAYOUTS), packing it (gemv_pack)
    or unpacking it as that needs; no value changes."""
    packed = layout == "packed"
    if (GEMV_LAYOUTS[lin.layout] == "packed") != packed:
        lin.plain = cpu_build.ops().gemv_pack(lin.plain) if packed else \
            lin.rows if lin.rows is not None else unpack(lin.plain)
    lin.layout = GEMV_LAYOUTS.index(layout)


def unpack(packed: Tensor) -> Tensor:
    """gemv_pack's inverse (kernels/cpu/kvscope_cpu.cpp: blocks of 16 rows, groups of 8, chunks of
    32 elements): [N/16, 2, K/32, 8, 32] back to [N, K]."""
    n, k = packed.shape
    return packed.view(n // 16, 2, k // 32, 8, 32).permute(0, 1, 3, 2, 4).contiguous().view(n, k)


def set_gemv(lin: Linear, way: str) -> None:
    """Run `lin`'s few-row calls as `way`: the GEMV on its operand in one of GEMV_LAYOUTS, or off
    (the backend's GEMM); off leaves the operand in rows, which for weights streamed in their own
    dtype is the weight itself, no copy."""
    lin.gemv = way != "off"
    relayout(lin, "rows" if way == "off" else way)


def replace_operand(lin: Linear, new: Tensor) -> Tensor:
    """Have `lin`'s GEMV read `new` (the same values, elsewhere in memory) in place of its operand,
    and its rows and GEMM weight too where they were that operand; returns the operand replaced."""
    old, lin.plain = lin.plain, new
    lin.rows = new if lin.rows is old else lin.rows
    lin.weight = new if lin.weight is old else lin.weight
    return old


def into_huge_pages(lins: list[Linear], params: Iterable[torch.nn.Parameter] = ()) -> None:
    """Move the GEMV operands of `lins`, as choose_gemv left them, into one mapping of 2 MB pages
    (kernels/huge_pages.py: fewer TLB misses as a decode step streams them). What held the same
    tensor takes the copy too, so no second copy stays: the Linear's GEMM weight and rows, and
    any of `params` (the model's, a tied embedding among them) on the same memory."""
    lins, old = [lin for lin in lins if lin.gemv], None
    by_memory = {(p.data_ptr(), p.shape, p.dtype): p for p in params}
    for lin, new in zip(lins, huge_page_copies([lin.plain for lin in lins])):
        old = replace_operand(lin, new)
        if (param := by_memory.get((old.data_ptr(), old.shape, old.dtype))) is not None:
            param.data = new
    del old  # the last copy replaced: freed before the heap goes back
    return_freed_memory()


def gemv_way(lin: Linear) -> str:
    return GEMV_LAYOUTS[lin.layout] if lin.gemv else "off"


@torch.inference_mode()
def choose_gemv(lins: list[Linear], rounds: int = 3, gemm: bool = True) -> str:
    """Run the one-row calls of `lins` (one kind of layer, say every layer's q|k|v) the way that
    streams their weights fastest on this machine, from memory or the cache as a decode step
    finds them: timed as a step calls them, one after another, each way in turn (rotated each
    round), the best of two passes after a warm one (weights just laid out are partly in
    cache), the median over rounds. The ways: the GEMV on rows, serial, or packed (bf16 operands:
    which reads faster depends on the machine, docs/benchmarks.md; packed, a copy, is chosen only
    PACKED_MARGIN faster than the others), or off, the backend's GEMM (where `gemm`: not for
    layers a decode step runs in one call of the kernels, engine/model/decode_step.py, nor for a
    GEMV copy in another dtype, whose half the bytes are that mode's point). Returns the way
    chosen."""
    lins = [lin for lin in lins if lin.gemv]
    if not lins:
        return "off"
    first = lins[0]
    gemm = gemm and first.plain.dtype == first.dtype
    ways = ["rows", "serial"] + ["packed"] * (first.plain.dtype == torch.bfloat16) + ["off"] * gemm
    xs = {(lin.in_features, lin.dtype): torch.randn(1, lin.in_features, dtype=lin.dtype) for lin in lins}

    def best_pass() -> float:
        times = []
        for _ in range(3):
            t0 = perf_counter()
            for lin in lins:
                lin(xs[lin.in_features, lin.dtype])
            times.append(perf_counter() - t0)
        return min(times[1:])

    times: dict[str, list[float]] = {way: [] for way in ways}
    for i in range(rounds if len(ways) > 1 else 0):
        for way in ways[i % len(ways):] + ways[:i % len(ways)]:
            for lin in lins:
                set_gemv(lin, way)
            times[way].append(best_pass())
    median = {way: sorted(t)[rounds // 2] if t else 0.0 for way, t in times.items()}
    best = min(ways, key=lambda way: median[way] * (PACKED_MARGIN if way == "packed" else 1.0))
    for lin in lins:
        set_gemv(lin, best)
    return best


def choose_backend(layers: list[torch.nn.Linear], repeats: int = 5,
                   gemv_dtype: torch.dtype | None = None) -> tuple[str, bool]:
    """(backend, gemv) for Linear: 'onednn' if the packed oneDNN path exists and runs these
    layers faster than F.linear on PACK_ROWS rows (the best of `repeats` rounds), else 'torch';
    gemv if the C++ kernels are loaded and kvscope.gemv takes these shapes and dtypes (whether it
    is faster at one row is choose_gemv's to time, on the whole model). Decided once per dtype
    and shapes."""
    w = layers[0].weight
    if w.device.type != "cpu":
        return "torch", False
    key = (w.dtype, gemv_dtype, tuple(tuple(layer.weight.shape) for layer in layers))
    if key not in _choice:
        backend = _fastest(layers, ["torch", "onednn"], PACK_ROWS, repeats) \
            if _onednn_ops() else "torch"
        _choice[key] = backend, cpu_build.loaded() and _gemv_runs(layers, gemv_dtype)
    return _choice[key]


@torch.inference_mode()
def _gemv_runs(layers: list[torch.nn.Linear], gemv_dtype: torch.dtype | None) -> bool:
    """kvscope.gemv takes these shapes and dtypes (K a multiple of its chunk, N of 16)."""
    try:
        for layer in layers:
            Linear([layer], gemv=True, gemv_dtype=gemv_dtype)(layer.weight.new_zeros(1, layer.in_features))
    except RuntimeError:
        return False
    return True


@torch.inference_mode()
def _fastest(layers: list[torch.nn.Linear], backends: list[str], rows: int, repeats: int) -> str:
    """The fastest of `backends` on these layers; the first when another fails (a private op changed)."""
    try:
        lins = {b: [Linear([layer], b) for layer in layers] for b in backends}
        inputs = [torch.randn(rows, layer.in_features, dtype=layer.weight.dtype) for layer in layers]
        times: dict[str, list[float]] = {b: [] for b in lins}
        for i in range(repeats + 1):  # the first round warms each up
            for b, group in lins.items():
                t0 = perf_counter()
                for lin, x in zip(group, inputs):
                    lin(x)
                if i:
                    times[b].append(perf_counter() - t0)
    except (RuntimeError, AttributeError):
        return backends[0]
    return min(times, key=lambda b: min(times[b]))  # the best round: other processes only ever add time

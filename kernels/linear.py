"""Linear layers for the engine's step: fused weights, and on the CPU the fastest GEMM backend.

On the CPU, torch's `F.linear` sends fp32 to MKL's sgemm (half speed on this project's AMD CPUs)
and re-lays out bf16 weights for oneDNN on every call. oneDNN with the weight reordered once
(`mkldnn._reorder_linear_weight`, the layout inductor's freezing pass uses) was 1.3-3x faster
here at 1 to 2,048 rows (docs/benchmarks.md). Those ops are private, so `choose_backend` checks
once per process and dtype that they exist and time faster than `F.linear` on the model's own
shapes (a few ms), and otherwise keeps `F.linear`.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

PACK_ROWS = 32  # oneDNN's layout hint: the decode batch; the same layout was best up to 2,048 rows
_choice: dict[tuple, str] = {}


def _onednn_ops() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


class Linear:
    """y = x W^T (+ b) for one weight, or several concatenated along the output (q|k|v, gate|up)."""

    def __init__(self, layers: list[torch.nn.Linear], backend: str = "torch"):
        weights = [layer.weight.detach() for layer in layers]
        biases = [layer.bias for layer in layers]
        self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        self.out_features = self.weight.shape[0]
        self.backend = backend
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)

    def __call__(self, x: Tensor) -> Tensor:
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def choose_backend(layers: list[torch.nn.Linear], rows: int = PACK_ROWS, repeats: int = 5) -> str:
    """'onednn' if the packed oneDNN path exists and runs these layers faster than F.linear
    (timed on `rows` rows, best of `repeats`), else 'torch'. Decided once per dtype and shapes."""
    w = layers[0].weight
    if w.device.type != "cpu" or not _onednn_ops():
        return "torch"
    key = (w.dtype, tuple(tuple(layer.weight.shape) for layer in layers))
    if key not in _choice:
        _choice[key] = _time_backends(layers, rows, repeats)
    return _choice[key]


@torch.inference_mode()
def _time_backends(layers: list[torch.nn.Linear], rows: int, repeats: int) -> str:
    try:
        candidates = {b: [Linear([layer], b) for layer in layers] for b in ("torch", "onednn")}
        inputs = [torch.randn(rows, layer.in_features, dtype=layer.weight.dtype) for layer in layers]
        times: dict[str, list[float]] = {b: [] for b in candidates}
        for i in range(repeats + 1):  # the first round warms both up
            for b, lins in candidates.items():
                t0 = time.perf_counter()
                for lin, x in zip(lins, inputs):
                    lin(x)
                if i:
                    times[b].append(time.perf_counter() - t0)
    except (RuntimeError, AttributeError):  # the private ops changed: keep the public path
        return "torch"
    return min(times, key=lambda b: min(times[b]))  # the best round: other processes only ever add time

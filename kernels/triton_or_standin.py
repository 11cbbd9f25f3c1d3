"""Triton where it is installed (torch's CUDA builds bring it: the GPU path), else a stand-in.

A CPU-only install has no Triton, and needs none: the kernels' torch and C++ siblings run there.
The stand-in lets the modules that define Triton kernels load, and says what is missing if one of
those kernels is ever launched (`kernel[grid](...)`, `triton.cdiv`: only on the GPU path).
"""
from __future__ import annotations

MISSING = ("Triton is not installed: the GPU kernels need it (`pip install 'kvscope[gpu]'`, or a CUDA "
           "build of torch, which brings it)")

try:
    import triton
    import triton.language as tl
except ImportError:
    class _Kernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(MISSING)

    class _Triton:
        @staticmethod
        def jit(fn=None, **options):
            return _Kernel(fn) if fn is not None else _Kernel

        def __getattr__(self, name: str):
            raise RuntimeError(MISSING)

    triton, tl = _Triton(), None

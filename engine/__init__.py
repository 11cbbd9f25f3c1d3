"""The paged engine.

OpenMP threads (torch's, oneDNN's, the C++ kernels') wait for work asleep rather than spinning,
unless OMP_WAIT_POLICY says otherwise. libgomp reads it once, when torch loads it, so it is set
only if torch is not loaded yet: every engine entry point imports this package first, and a
process that loaded torch before (vLLM with the KVScope plugin) keeps its own setting. On this
project's shared 2-core machine, spinning threads made a 2-thread engine 5-50x slower whenever
other processes wanted the cores (docs/benchmarks.md).
"""
import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

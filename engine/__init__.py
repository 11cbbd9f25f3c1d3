"""The paged engine.

OpenMP threads (torch's, oneDNN's, the C++ kernels') wait for work asleep rather than spinning,
unless OMP_WAIT_POLICY says otherwise. It must be set before torch loads libgomp, and every
engine entry point imports this package first. On this project's shared 2-core machine,
spinning threads made a 2-thread engine 5-50x slower whenever other processes wanted the cores
(bf16, 32 prompts: 75-645 tok/s spinning, 461-500 tok/s asleep; docs/benchmarks.md).
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

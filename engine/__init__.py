"""The paged engine.

OpenMP threads (torch's, oneDNN's, the C++ kernels') spin briefly when they run out of work,
then sleep: GOMP_SPINCOUNT=1000 (about 20 µs here) bridges the gaps between the operators of one
step, where waking a sleeping thread for each of a step's ~150 parallel operators cost 5-6 ms (a
batch-1 decode step: 14.6 ms asleep, 8-10 ms with the short spin); it is short enough that a
thread waiting through a stall sleeps soon. Spinning without a bound (OMP_WAIT_POLICY=ACTIVE, or
libgomp's default of 300,000) made the engine 2-7x slower whenever another process wanted the
cores of this project's shared 2-core machine; the short spin costs +20-55% then, sleeping
nothing (docs/benchmarks.md). Set either variable to choose otherwise. libgomp reads them once,
when torch loads it, so this happens only if torch is not loaded yet: every engine entry point
imports this package first, and a process that loaded torch before (vLLM with the KVScope
plugin) keeps its own setting.
"""
import os
import sys

if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
    os.environ["GOMP_SPINCOUNT"] = "1000"

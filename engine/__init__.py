"""The paged engine.

OpenMP threads (torch's, oneDNN's, the C++ kernels') spin briefly when they run out of work,
then sleep: GOMP_SPINCOUNT=1000 (about 20 µs) bridges the gaps between the operators of one
step, so a step does not wake a sleeping thread for each of its operators, and is short enough
that a thread waiting through a stall soon sleeps and leaves the cores to other processes
(unbounded spinning slows the engine down whenever another process wants a core; the
measurements are in docs/benchmarks.md). Set either variable to choose otherwise. libgomp reads
them once, when torch loads it, so this happens only if torch is not loaded yet: every engine
entry point imports this package first, and a process that loaded torch before (vLLM with the
KVScope plugin) keeps its own setting.
"""
import os
import sys

if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
    os.environ["GOMP_SPINCOUNT"] = "1000"

"""The C++ CPU kernel variants (avx512, avx2, generic) a test runs once each: those this CPU can
execute, the others skipped with the reason (tests/unit/conftest.py's `isa` fixture)."""
from __future__ import annotations

import pytest

from engine.model.model_loader import default_cache_dir
from kernels import cpu_build

BUILD_DIR = default_cache_dir() / "kernels"


def isa_params() -> list:
    ok, why_not = cpu_build.supported()
    params = []
    for isa in cpu_build.ISAS:
        runs, why = cpu_build.runnable(isa)
        params.append(pytest.param(isa, id=isa, marks=pytest.mark.skipif(not (ok and runs),
                                                                         reason=f"{isa}: {why or why_not}")))
    return params

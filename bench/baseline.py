"""The C++ CPU kernels as they were at a git revision, loaded beside today's: a kernel change
A/B-tested in one process (bench/gemv.py, bench/cpu_variants.py: a side `<isa>@REV`).

The revision's kernels/cpu/kvscope_cpu.cpp is built for one variant with its op namespace renamed
(torch.ops.kvscope_at_<rev>_<isa>), so it loads next to today's torch.ops.kvscope_<isa>.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.model.model_loader import default_cache_dir
from kernels import cpu_build

ROOT = Path(__file__).resolve().parents[1]
BUILD_DIR = default_cache_dir() / "kernels"
_loaded: set[str] = set()


def variant_name(isa: str, rev: str) -> str:
    """'at_HEAD_1_avx2' for ('avx2', 'HEAD~1'): the ops are torch.ops.kvscope_<this>."""
    return f"at_{re.sub(r'[^A-Za-z0-9]', '_', rev)}_{isa}"


def load(isa: str, rev: str) -> str:
    """Build (cached) and load the revision's `isa` kernels; returns their variant_name. A
    revision git does not know (or without the kernels' source) is a ValueError saying so."""
    name = variant_name(isa, rev)
    if name in _loaded:
        return name
    show = subprocess.run(["git", "show", f"{rev}:kernels/cpu/kvscope_cpu.cpp"], cwd=ROOT, capture_output=True,
                          text=True)
    if show.returncode:
        raise ValueError(f"no kernels at git revision {rev!r}: {show.stderr.strip()}")
    text = show.stdout
    text = text.replace("#define KVSCOPE_NS kvscope_", f"#define KVSCOPE_NS kvscope_{name.removesuffix(isa)}")
    key = hashlib.sha256("\n".join([text, isa, torch.__version__]).encode()).hexdigest()[:16]
    lib = BUILD_DIR / f"kvscope_cpu-{name}-{key}.so"
    if not lib.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "kvscope_cpu.cpp"
            src.write_text(text)
            run = subprocess.run(cpu_build.compile_command(isa, Path(tmp) / "lib.so", source=src),
                                 capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"building {isa}@{rev} failed:\n{run.stderr[-2000:]}")
            (Path(tmp) / "lib.so").replace(lib)
    torch.ops.load_library(str(lib))
    _loaded.add(name)
    return name

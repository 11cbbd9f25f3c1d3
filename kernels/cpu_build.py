"""Build and load the C++ CPU kernels (kernels/cpu/kvscope_cpu.cpp -> torch.ops.kvscope.*).

One g++ call (about 30 s on 2 cores) makes a shared library for this CPU (-march=native) and this
torch; it is cached under a folder named by a hash of the source, the flags, torch's version and
the CPU's feature flags, so a change to any of them builds anew and nothing stale is ever loaded.
`make install` builds it; otherwise the first engine start does. Without a compiler, on another
OS or CPU family, or with KVSCOPE_CPU_KERNELS=0, `load` returns False and the engine uses the
torch path instead (same results, slower).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.utils.cpp_extension as cpp

SOURCE = Path(__file__).with_name("cpu") / "kvscope_cpu.cpp"
# -ffp-contract=off: no fused multiply-adds, so each product is rounded as torch rounds it
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w"]
_state: dict[str, object] = {}


@functools.cache  # read once: the attention asks on every layer of every step
def _cpu_flags() -> str:
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _command(out: Path) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = Path(torch.__file__).parent / "lib"
    return (["g++", *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
            + [f"-I{p}" for p in cpp.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
            + [str(SOURCE), "-o", str(out), f"-L{libs}", f"-Wl,-rpath,{libs}", "-lc10", "-ltorch_cpu", "-ltorch"])


def library_path(build_dir: Path) -> Path:
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), torch.__version__, _cpu_flags()])
                         .encode()).hexdigest()[:16]
    return Path(build_dir) / f"kvscope_cpu-{key}.so"


def supported() -> tuple[bool, str]:
    """Whether this machine can build the kernels, and if not, why."""
    if os.environ.get("KVSCOPE_CPU_KERNELS", "1") == "0":
        return False, "turned off by KVSCOPE_CPU_KERNELS=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"built only on x86-64 Linux (this is {sys.platform} {platform.machine()})"
    if shutil.which("g++") is None:
        return False, "no g++ on PATH"
    return True, ""


def build(build_dir: Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """Compile unless a library for this source, torch and CPU is already there (a file lock
    keeps two processes from building at once)."""
    lib = library_path(build_dir)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():  # another process built it while we waited
            return lib
        progress(f"building the CPU kernels (once per machine, ~30 s): {lib.name}")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            run = subprocess.run(_command(Path(tmp)), capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"g++ failed ({run.returncode}):\n{run.stderr[-4000:]}")
            os.replace(tmp, lib)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return lib


def load(build_dir: Path, progress: Callable[[str], None] = lambda _: None) -> bool:
    """Build if needed and register torch.ops.kvscope.*; False (with `status()` saying why)
    when this machine cannot have them."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    ok, why = supported()
    if ok:
        try:
            torch.ops.load_library(str(build(build_dir, progress)))
        except (RuntimeError, OSError) as e:
            ok, why = False, f"build or load failed: {e}"
    _state.update(loaded=ok, why=why)
    if not ok:
        progress(f"CPU kernels unavailable ({why.splitlines()[0]}); using the torch path")
    return ok


def has_avx512() -> bool:
    """The library was built with AVX-512 kernels (-march=native on a CPU that has it)."""
    return loaded() and _flag("avx512f")


@functools.cache
def _flag(name: str) -> bool:
    return name in _cpu_flags().split()


def loaded() -> bool:
    return bool(_state.get("loaded"))


def status() -> str:
    if "loaded" not in _state:
        return "not loaded yet"
    return "loaded" if _state["loaded"] else str(_state["why"])

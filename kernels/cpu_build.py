"""Build and load the C++ CPU kernels (kernels/cpu/kvscope_cpu.cpp -> torch.ops.kvscope_<isa>.*).

One source, three variants (ISAS): `avx512` (16-wide, AVX512-BF16 dot products where the CPU has
them), `avx2` (8-wide AVX2 + FMA + F16C) and `generic` (portable C++ the compiler vectorises, for
every other CPU, arm64 included). Each is its own library with its own op namespace
(torch.ops.kvscope_avx2, ...), so tests load several in one process. The engine uses the best
this CPU runs (`chosen_isa`); KVSCOPE_CPU_ISA=avx512|avx2|generic forces one.

One g++ call (about 30 s on 2 cores) makes a variant's library for this CPU and this torch; it is
cached under a name hashed from the source, the variant's flags, torch's version and the CPU's
feature flags, so a change to any of them builds anew and nothing stale is ever loaded.
`make install` builds the chosen one; otherwise the first engine start does. Without a compiler,
outside Linux, or with KVSCOPE_CPU_KERNELS=0, `load` returns False and the engine uses the torch
path instead (same results, slower). macOS stays on the torch path: Apple's clang has no OpenMP.
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
ISAS = ("avx512", "avx2", "generic")  # best first
# what each x86 variant needs in /proc/cpuinfo's flags
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma", "f16c"), "generic": ()}
# -ffp-contract=off: no fused multiply-adds the source did not ask for, so each product is
# rounded as torch rounds it
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w"]
_state: dict[str, object] = {}
_libraries: dict[str, Path] = {}  # variants loaded into this process


class IsaError(ValueError):
    """KVSCOPE_CPU_ISA names a variant this CPU cannot run (or none at all)."""


@functools.cache  # read once: the attention asks on every layer of every step
def _cpu_flags() -> str:
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return platform.processor()


def cpu_flags() -> list[str]:
    """The CPU's feature flags (/proc/cpuinfo), for the benchmarks' reports."""
    return _cpu_flags().partition(":")[2].split()


@functools.cache
def _flag(name: str) -> bool:
    return name in cpu_flags()


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def runnable(isa: str) -> tuple[bool, str]:
    """Whether this CPU executes the variant, and if not, why (one line)."""
    if isa not in ISAS:
        return False, f"unknown variant {isa!r} (one of {', '.join(ISAS)})"
    if isa != "generic" and not _x86():
        return False, f"{isa} is x86 only (this is {platform.machine()})"
    missing = [f for f in NEEDS[isa] if not _flag(f)]
    if missing:
        return False, f"this CPU lacks {', '.join(missing)}"
    return True, ""


def runnable_isas() -> list[str]:
    return [isa for isa in ISAS if runnable(isa)[0]]


def chosen_isa() -> str:
    """KVSCOPE_CPU_ISA if set (an IsaError if this CPU cannot run it), else the best it runs."""
    forced = os.environ.get("KVSCOPE_CPU_ISA", "").strip().lower()
    if not forced:
        return runnable_isas()[0]
    ok, why = runnable(forced)
    if not ok:
        raise IsaError(f"KVSCOPE_CPU_ISA={forced}: {why}; this CPU runs {', '.join(runnable_isas())}")
    return forced


def target_flags(isa: str, native: bool = True) -> list[str]:
    """-march/-mcpu and the variant's macro. native=False: a cross build for aarch64 (generic)."""
    define = f"-DKVSCOPE_ISA_{isa.upper()}"
    if isa == "avx512":
        return ["-march=native", define]
    if isa == "avx2":  # this CPU's tuning, but no AVX-512 even where the CPU has it
        return ["-march=native", "-mno-avx512f", define]
    if not native:
        return ["-march=armv8-a", define]
    if platform.machine() in ("aarch64", "arm64"):
        return ["-mcpu=native", define]
    return (["-march=native"] if _x86() else []) + [define]


def compile_command(isa: str, out: Path, compiler: str = "g++", native: bool = True,
                    compile_only: bool = False, source: Path = SOURCE) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = Path(torch.__file__).parent / "lib"
    link = [] if compile_only else [f"-L{libs}", f"-Wl,-rpath,{libs}", "-lc10", "-ltorch_cpu", "-ltorch"]
    flags = [f for f in FLAGS if not (compile_only and f == "-shared")] + (["-c"] if compile_only else [])
    return ([compiler, *flags, *target_flags(isa, native), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             "-DTORCH_API_INCLUDE_EXTENSION_H"]
            + [f"-I{p}" for p in cpp.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
            + [str(source), "-o", str(out)] + link)


def library_path(build_dir: Path, isa: str) -> Path:
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS + target_flags(isa)), torch.__version__,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return Path(build_dir) / f"kvscope_cpu-{isa}-{key}.so"


def supported() -> tuple[bool, str]:
    """Whether this machine can build the kernels, and if not, why."""
    if os.environ.get("KVSCOPE_CPU_KERNELS", "1") == "0":
        return False, "turned off by KVSCOPE_CPU_KERNELS=0"
    if sys.platform != "linux":
        return False, f"built only on Linux (this is {sys.platform} {platform.machine()}; macOS: no OpenMP in clang)"
    if shutil.which("g++") is None:
        return False, "no g++ on PATH"
    return True, ""


def build(build_dir: Path, isa: str, progress: Callable[[str], None] = lambda _: None) -> Path:
    """Compile the variant unless a library for this source, torch and CPU is already there (a
    file lock keeps two processes from building at once)."""
    lib = library_path(build_dir, isa)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():  # another process built it while we waited
            return lib
        progress(f"building the {isa} CPU kernels (once per machine, ~30 s): {lib.name}")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            run = subprocess.run(compile_command(isa, Path(tmp)), capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"g++ failed ({run.returncode}):\n{run.stderr[-4000:]}")
            os.replace(tmp, lib)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return lib


def load_variant(build_dir: Path, isa: str, progress: Callable[[str], None] = lambda _: None):
    """Build if needed and register torch.ops.kvscope_<isa>; returns that namespace. Raises
    IsaError if this CPU cannot run it, RuntimeError/OSError if it does not build or load."""
    ok, why = runnable(isa)
    if not ok:
        raise IsaError(f"the {isa} kernels: {why}")
    if isa not in _libraries:
        lib = build(build_dir, isa, progress)
        torch.ops.load_library(str(lib))
        _libraries[isa] = lib
    return getattr(torch.ops, f"kvscope_{isa}")


def load(build_dir: Path, progress: Callable[[str], None] = lambda _: None) -> bool:
    """Build if needed and load the variant the engine uses (`chosen_isa`); False (with
    `status()` saying why) when this machine cannot have it. A KVSCOPE_CPU_ISA this CPU cannot
    run raises IsaError."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    ok, why = supported()
    isa = chosen_isa() if ok else None
    if ok:
        try:
            load_variant(build_dir, isa, progress)
        except (RuntimeError, OSError) as e:
            ok, why = False, f"build or load failed: {e}"
    _state.update(loaded=ok, why=why, isa=isa if ok else None)
    if not ok:
        progress(f"CPU kernels unavailable ({why.splitlines()[0]}); using the torch path")
    return ok


def use(isa: str, build_dir: Path) -> None:
    """Make `isa` the variant every kernel call goes to (tests and benchmarks compare them)."""
    load_variant(build_dir, isa)
    _state.update(loaded=True, why="", isa=isa)


def ops():
    """The loaded variant's op namespace: torch.ops.kvscope_<isa>."""
    return getattr(torch.ops, f"kvscope_{_state['isa']}")


def isa() -> str | None:
    """The variant in use; None on the torch path."""
    return _state.get("isa") if loaded() else None


def loaded() -> bool:
    return bool(_state.get("loaded"))


def status() -> str:
    if "loaded" not in _state:
        return "not loaded yet"
    return f"loaded ({_state['isa']})" if _state["loaded"] else str(_state["why"])


def cross_check(compiler: str) -> None:
    """Compile (-c, no link) the generic variant with a cross compiler for aarch64: it keeps
    compiling for arm64 CPUs where no test runs here. Raises RuntimeError with g++'s message."""
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(compile_command("generic", Path(tmp) / "kvscope_cpu-generic.o", compiler, native=False,
                                             compile_only=True), capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed ({run.returncode}):\n{run.stderr[-4000:]}")


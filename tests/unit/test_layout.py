"""The layout keeps its promises: the contract (kvscope_contract) imports nothing but the
standard library, msgspec and numpy; the dashboard reaches the engine only through the
contract; each room imports only the rooms below it; no module imports itself back through a
cycle."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvscope_contract", "app", "engine", "kernels", "integrations", "tools", "kvscope")

# The dashboard's data packages, bottom first: each imports only the packages before it (`<`), never
# one beside it (`,`); none imports streamlit or the rooms that draw (app/ui, app/panels, app/modes).
DATA = "history < link < derived, fleet, export < lessons"
DATA_LAYERS = [[f"app.{name.strip()}" for name in layer.split(",")] for layer in DATA.split("<")]
DATA_PACKAGES = [p for layer in DATA_LAYERS for p in layer]
ROOMS = ("app.ui", "app.panels", "app.modes")  # what draws, above the data packages


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
    for f in (ROOT / "kvscope_contract").rglob("*.py"):
        for name in imports(f):
            top = name.split(".")[0]
            assert (top in sys.stdlib_module_names or top in ("msgspec", "numpy", "__future__")
                    or top == "kvscope_contract"), f"{f.relative_to(ROOT)} imports {name}"


def test_importing_the_contract_leaves_the_engine_unloaded():
    """engine/__init__.py sets the engine's OpenMP spin; a dashboard that imports the contract
    must not get it (nor the engine package at all)."""
    modules = ", ".join(module_name(f) for f in sorted((ROOT / "kvscope_contract").rglob("*.py")))
    code = (f"import os, sys\nimport {modules}\n"
            "assert 'engine' not in sys.modules, 'the contract loaded the engine package'\n"
            "assert 'GOMP_SPINCOUNT' not in os.environ, 'the contract set the engine OpenMP spin'")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT, env=env)


def test_the_dashboard_reaches_the_engine_only_through_the_contract():
    for f in (ROOT / "app").rglob("*.py"):
        for name in imports(f):
            assert name.split(".")[0] not in ("engine", "kernels", "torch", "transformers"), \
                f"{f.relative_to(ROOT)} imports {name}"


def test_app_holds_the_data_packages_and_the_rooms_that_draw():
    """A new package of app/ is placed in DATA (or among the ROOMS) before anything imports it."""
    packages = {f"app.{d.name}" for d in (ROOT / "app").iterdir() if (d / "__init__.py").is_file()}
    assert packages == set(DATA_PACKAGES) | set(ROOMS)


@pytest.mark.parametrize("package", DATA_PACKAGES)
def test_a_data_package_imports_only_those_below_it_and_never_streamlit(package):
    """What a script, a test or another front end can use without a Streamlit session: the history,
    the link to an engine, what is derived from them, the fleet, the export, the lessons' model."""
    level = next(i for i, layer in enumerate(DATA_LAYERS) if package in layer)
    below = {package} | {p for layer in DATA_LAYERS[:level] for p in layer}
    files = list((ROOT / package.replace(".", "/")).rglob("*.py"))
    assert len(files) > 1, package
    for f in files:
        for name in imports(f):
            assert name.split(".")[0] not in ("streamlit", "altair"), f"{f.relative_to(ROOT)} imports {name}"
            if name.split(".")[0] == "app":
                assert ".".join(name.split(".")[:2]) in below, \
                    f"{f.relative_to(ROOT)} imports {name}: {package} is above only {sorted(below - {package})}"


def assert_never_imports(folder: str, below: tuple[str, ...]) -> None:
    files = list((ROOT / folder).rglob("*.py"))
    assert files, folder
    for f in files:
        for name in imports(f):
            assert not name.startswith(below), f"{f.relative_to(ROOT)} imports {name}"


def test_the_sidebar_and_chrome_never_import_panels_or_pages():
    """app/ui/ (sidebar controls, time travel, connection, palette) is below the panels, which
    draw with it, and the pages: what both need lives in app/ui/ or a data package (DATA)."""
    assert_never_imports("app/ui", ("app.panels", "app.modes"))


def test_the_panels_never_import_the_pages():
    assert_never_imports("app/panels", ("app.modes",))


def test_every_page_module_draws():
    """app/modes/ holds what draws a page; a module there that never imports streamlit is the
    page's logic (a lesson's model, a launcher's plan) and belongs in a data package (DATA) or tools/."""
    for f in (ROOT / "app" / "modes").rglob("*.py"):
        if f.name != "__init__.py":
            assert "streamlit" in {n.split(".")[0] for n in imports(f)}, f"{f.relative_to(ROOT)} draws nothing"


def test_the_engine_core_needs_no_model_server_or_lab():
    """engine/core/ is the engine without a model: the lab, the synthetic engine and the vLLM
    plugin run it (or its event log) with no model loaded."""
    for f in (ROOT / "engine" / "core").rglob("*.py"):
        for name in imports(f):
            top = name.split(".")[0]
            assert top not in ("torch", "transformers", "kernels"), f"{f.relative_to(ROOT)} imports {name}"
            assert top != "engine" or name.startswith("engine.core"), f"{f.relative_to(ROOT)} imports {name}"


def test_the_integrations_never_import_the_model_side():
    """An integration runs inside another engine (vLLM's process, a KV-event stream): KVScope's
    model, runner and kernels are not theirs to load."""
    assert_never_imports("integrations", ("engine.model", "kernels"))


def test_the_kv_event_mode_needs_neither_torch_nor_vllm():
    """The dashboard imports it: a ZMQ stream is read without any engine installed (of KVScope's
    engine, only the torch-free contract)."""
    for f in (ROOT / "integrations" / "kv_events").rglob("*.py"):
        for name in imports(f):
            assert name.split(".")[0] not in ("torch", "transformers", "vllm", "engine", "kernels"), \
                f"{f.relative_to(ROOT)} imports {name}"


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

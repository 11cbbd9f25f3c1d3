"""The wheel installs one top-level package, `kvscope`.

The checkout keeps app/, engine/, kernels/, integrations/, kvscope_contract/ and assets/ at its top
level, importing each other by those names; the wheel maps them inside kvscope/ (package_dir) and
its build writes each import of them as `kvscope.<folder>` (`qualified`). So a pip install adds
nothing under a name another project may use (a package called `engine` beside it keeps its own).
An editable install does not rewrite: it finds `kvscope`, which puts the checkout on the path.
"""
from __future__ import annotations

import ast
import re

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

OURS = ("app", "engine", "kernels", "integrations", "kvscope_contract", "assets")
PACKAGE = "kvscope"


def qualified(source: str, path: str = "<source>") -> str:
    """`source` with every import of our folders written under PACKAGE: `from engine.x import y`
    -> `from kvscope.engine.x import y`, `import kernels` -> `from kvscope import kernels`,
    `import engine.x as z` -> `import kvscope.engine.x as z`. An import it cannot write so that
    the same names are bound (`import engine.x` without `as`, ours mixed with others) is refused."""
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []  # (line, start col, end col, new text)
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in OURS:
            line = lines[node.lineno - 1]
            m = re.compile(r"from\s+" + re.escape(node.module) + r"\b").match(line, node.col_offset)
            if m is None:
                raise ValueError(f"{path}:{node.lineno}: cannot find `from {node.module}` on its line")
            edits.append((node.lineno, m.start(), m.end(), f"from {PACKAGE}.{node.module}"))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] in OURS for a in node.names):
            (alias,) = node.names if len(node.names) == 1 else (None,)
            if alias is None or (alias.asname is None and "." in alias.name):
                raise ValueError(f"{path}:{node.lineno}: write `from ... import ...` or one `import x.y as z`")
            text = (f"import {PACKAGE}.{alias.name} as {alias.asname}" if alias.asname
                    else f"from {PACKAGE} import {alias.name}")
            edits.append((node.lineno, node.col_offset, node.end_col_offset, text))
            if node.end_lineno != node.lineno:
                raise ValueError(f"{path}:{node.lineno}: an import of ours over several lines")
    for lineno, start, end, text in sorted(edits, reverse=True):
        line = lines[lineno - 1]
        lines[lineno - 1] = line[:start] + text + line[end:]
    return "".join(lines)


class BuildPy(build_py):
    """Copies the modules as setuptools does, then qualifies their imports (not in editable mode,
    where nothing is copied)."""

    def build_module(self, module, module_file, package):
        out, copied = super().build_module(module, module_file, package)
        if not self.editable_mode and package.split(".")[0] == PACKAGE:
            with open(out, encoding="utf-8") as f:
                source = f.read()
            with open(out, "w", encoding="utf-8") as f:
                f.write(qualified(source, module_file))
        return out, copied


packages = find_namespace_packages(include=[f"{o}" for o in OURS] + [f"{o}.*" for o in OURS],
                                   exclude=["*.__pycache__"])
setup(
    packages=[PACKAGE] + [f"{PACKAGE}.{p}" for p in packages],
    package_dir={PACKAGE: PACKAGE, **{f"{PACKAGE}.{o}": o for o in OURS}},
    package_data={f"{PACKAGE}.kernels": ["cpu/*.cpp"],  # the C++ CPU kernels' source, compiled on the user's machine
                  f"{PACKAGE}.app": [".streamlit/config.toml"],  # Streamlit reads it beside main.py: loopback only
                  f"{PACKAGE}.app.lessons": ["*.toml", "fleet/*.toml", "trace/*.toml"],
                  # not the README's screenshots; the lesson's trace slice with its licence
                  f"{PACKAGE}.assets": ["*.js", "*.css", "*.jsonl", "*.svg", "mooncake/*"]},
    cmdclass={"build_py": BuildPy},
)

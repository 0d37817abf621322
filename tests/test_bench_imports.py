"""The benchmarks import names of the library that exist: no test runs a bench (make bench does),
so a name moved between modules broke bench.generation unnoticed. Each bench's `from halludetect...
import ...` (anywhere in the file) is resolved without running the bench, whose module-level code
pins numerics and threads."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def library_imports(path: Path) -> list[tuple[int, str, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("halludetect"):
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_every_library_name_a_bench_imports_exists(path):
    missing = []
    for line, module, name in library_imports(path):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"bench/{path.name}:{line}: {module} has no {name}")
    assert not missing, missing

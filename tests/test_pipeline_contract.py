"""DVC's recompute contract, checked against the code: every stage lists exactly the modules it
runs and declares the params it reads, and params.yaml is the one source of defaults.

DVC re-runs a stage when a listed dependency changes, and only then. A module a stage imports
(at the top of a file or inside a function, directly or through another module) but that
`dvc.yaml` does not list could change results while DVC calls the outputs current; a listed
module the stage never runs makes DVC re-run it for nothing. Both are failures here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from halludetect import config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("halludetect", "stages")
# The front door: lazy re-exports for library users, never imported by a stage for its
# behaviour (test_front_door_runs_nothing_at_import holds it to that), so no stage lists it.
FRONT_DOOR = ROOT / "halludetect" / "__init__.py"


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def imports_of(path: Path, package: str) -> set[str]:
    """Our modules that `path` imports anywhere in its body (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES and module_file(n)}
    return found


def closure(module: str) -> set[Path]:
    """Every file of ours that runs when `python -m module` runs: imports, transitively, and
    the `__init__.py` of every package on the way (Python executes them on import)."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for k in range(1, len(parts) + 1):  # parent packages first
            path = module_file(".".join(parts[:k]))
            if path is None or path in seen:
                continue
            seen.add(path)
            package = ".".join(parts[:k]) if path.name == "__init__.py" else ".".join(parts[: k - 1])
            todo += imports_of(path, package)
    return seen - {FRONT_DOOR}


def stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def stage_module(stage: dict) -> str:
    match = re.match(r"\s*python -m (stages\.\w+)", stage["cmd"])
    assert match, f"stage command does not run a stages module: {stage['cmd']!r}"
    return match.group(1)


def code_deps(stage: dict) -> list[Path]:
    return [ROOT / d for d in stage.get("deps", []) if d.split("/")[0] in PACKAGES]


@pytest.mark.parametrize("name", sorted(stages()))
def test_every_stage_lists_exactly_the_code_it_runs(name):
    stage = stages()[name]
    runs = closure(stage_module(stage))
    deps = code_deps(stage)
    covered = {f for f in runs if any(f == d or d in f.parents for d in deps)}
    missing = sorted(str(f.relative_to(ROOT)) for f in runs - covered)
    assert not missing, f"{name}: dvc.yaml does not list {missing}, which the stage runs"
    for d in deps:
        assert d.exists(), f"{name}: listed dependency {d.relative_to(ROOT)} does not exist"
        files = {d} if d.is_file() else set(d.rglob("*.py"))
        unused = sorted(str(f.relative_to(ROOT)) for f in files - runs)
        assert not unused, (f"{name}: lists {d.relative_to(ROOT)}, but never runs {unused} "
                            "(list the files it runs instead, or DVC re-runs it for their edits)")


def test_the_contract_test_sees_function_level_imports_and_package_inits(tmp_path):
    # `dump` imports its model-side helpers; `world_check` reaches generation through
    # halludetect.world.check, and every stage runs stages/__init__.py.
    runs = {str(p.relative_to(ROOT)) for p in closure("stages.world_check")}
    assert {"halludetect/generation.py", "halludetect/model_inputs.py", "halludetect/world/__init__.py",
            "stages/__init__.py"} <= runs
    assert "halludetect/world/tiny_llama.py" not in runs  # the check never trains


def test_front_door_runs_nothing_at_import():
    tree = ast.parse(FRONT_DOOR.read_text())
    for node in tree.body:  # module level: only the lazy table, the hook and docstrings
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            assert all(n in ("__future__", "importlib") for n in names), f"front door imports {names}"


# ------------------------------------------------------------------------------ params
def params_read(module_path: Path) -> set[str]:
    """Dotted params keys a stage module reads: `params.a.b...` chains, and the preset lookups."""
    keys = set()
    for node in ast.walk(ast.parse(module_path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "params":
            keys.add({"model": "models.*", "dataset": "datasets.*"}.get(node.func.attr, node.func.attr))
        elif isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "params" and chain[-1] not in ("model", "dataset"):
                keys.add(".".join(reversed(chain)))
    # Only the longest chains: `params.train.seeds` also yields `params.train`.
    return {k for k in keys if not any(o != k and o.startswith(k + ".") for o in keys)}


def declared(stage: dict) -> list[str]:
    out = []
    for p in stage.get("params", []):
        out += list(p) if isinstance(p, dict) else [p]
    return [re.sub(r"\$\{item\.\w+\}", "*", p) for p in out]


def covers(decl: str, key: str) -> bool:
    """A declared key covers what it is a prefix of, and a read section it is part of
    (`detectors.*` covers `params.detectors` passed on to pick the method's section)."""
    a, b = decl.split("."), key.split(".")
    n = min(len(a), len(b))
    return all(x == y or "*" in (x, y) for x, y in zip(a[:n], b[:n]))


@pytest.mark.parametrize("name", sorted(stages()))
def test_every_stage_declares_the_params_it_reads(name):
    stage = stages()[name]
    path = module_file(stage_module(stage))
    undeclared = sorted(k for k in params_read(path) if not any(covers(d, k) for d in declared(stage)))
    assert not undeclared, f"{name} reads params {undeclared} that dvc.yaml does not declare"


STAGE_SECTIONS = ["world", "prepare", "generate", "dump", "judge", "cluster", "detectors", "baselines", "train",
                  "evaluate", "export", "latency", "analyze"]


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("section", STAGE_SECTIONS)
def test_params_yaml_is_the_one_source_of_defaults(section):
    """Every key of a stage's section is written in params.yaml, and the code's default is the
    same value: a library user calling `GenerateParams()` gets what `dvc repro` runs."""
    written = yaml.safe_load((ROOT / "params.yaml").read_text())[section]
    model = config.Params.model_fields[section].annotation
    defaults = flatten(model().model_dump(mode="json"))
    assert sorted(flatten(written)) == sorted(defaults), f"params.yaml {section}: keys differ from the code's"
    validated = flatten(model.model_validate(written).model_dump(mode="json"))
    differ = {k: (validated[k], defaults[k]) for k in defaults if validated[k] != defaults[k]}
    assert not differ, f"params.yaml {section} (value, code default) differ: {differ}"


@pytest.mark.parametrize("stage", ["report", "prepare", "baselines", "judge", "cluster"])
def test_stages_without_a_model_do_not_load_torch(stage):
    """A stage imports only what it runs: the report and the label stages start in a fraction
    of a second instead of loading torch to catch exception classes."""
    import subprocess
    import sys

    code = f"import sys, stages.{stage}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

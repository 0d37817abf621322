"""The library's layout: folders by pipeline phase, imports only pointing down.

Each folder of halludetect/ (and each top-level module) has a floor; a module may import modules
of its own folder or of a lower floor, never a higher one or a sibling on its floor. With no
cycle between modules either, a newcomer can read the library from the bottom up: every name a
module uses is defined below it or beside it. The imports are read as the DVC contract reads them
(halludetect/core/code_deps.py: function-level imports included).
"""

from __future__ import annotations

import graphlib

import pytest

from halludetect.core import code_deps

# Bottom to top. A folder or a top-level module (config, prompts, metrics, cli) per entry.
FLOORS = [
    ["core"],  # errors, atomic writes, artifact readers, lookups, numerics, devices, unit stores, sections,
    # the endpoint machinery and its call cache (used by the sampler in lm/ and the judge in labels/)
    ["methods"],  # one file per detection method: params, traits, how its network is built
    ["config", "prompts", "metrics"],
    ["lm", "qa"],  # the base model; QA records
    ["labels", "activations"],
    ["detectors", "testing"],
    ["evaluation"],  # metrics of a trained detector: best layer, thresholds, calibration, transfer
    ["scoring"],  # the bundle file a detector travels in, its export, and scoring new answers
    ["report", "world"],
    ["runner"],  # `halludetect repro`: the parallel runner, the stage zygote, the lock writer, the progress line,
    # the DAG view, and runner/dvc_internals.py, the one module that imports DVC (the experiments use it too)
    ["experiments"],
    ["cli"],  # the `halludetect` command
]
FLOOR = {place: k for k, places in enumerate(FLOORS) for place in places}
ROOT = code_deps.ROOT / "halludetect"


def modules() -> dict[str, str]:
    """Every module of the library (dotted name -> its place: folder or top-level module)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.as_posix() == "__init__":
            continue  # the front door: lazy names only (test_pipeline_contract holds it to that)
        name = ".".join(("halludetect", *rel.parts)).removesuffix(".__init__")
        out[name] = rel.parts[0]
    return out


def imports(name: str) -> set[str]:
    path = code_deps.module_file(name)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for dep in code_deps.imports_of(path, package):
        while code_deps.module_file(dep) is None or dep.startswith("stages"):
            if dep.startswith("stages"):
                raise AssertionError(f"{name} imports {dep}: the library never imports a stage")
            dep = dep.rsplit(".", 1)[0]
        if dep not in ("halludetect", name):
            found.add(dep)
    return found


def test_every_folder_and_top_level_module_has_a_floor():
    places = set(modules().values())
    assert places - set(FLOOR) == set(), "give new folders a floor in FLOORS (and say why in the docs)"
    assert set(FLOOR) - places == set(), "FLOORS names places that no longer exist"


def upward(name: str) -> list[str]:
    """The imports of `name` that point up or sideways, each explained."""
    place, found = modules()[name], []
    for dep in sorted(imports(name)):
        there = modules()[dep]
        if there != place and FLOOR[there] >= FLOOR[place]:
            found.append(f"{name} (floor {FLOOR[place]}, {place}) imports {dep} (floor {FLOOR[there]}, {there})")
    return found


@pytest.mark.parametrize("name", sorted(modules()))
def test_imports_point_down(name):
    bad = upward(name)
    assert not bad, f"{bad}: imports point down only; move the shared code to a lower floor"


def test_no_import_cycle():
    graph = {name: imports(name) for name in modules()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """A core module importing a detector inside a function fails: the check reads what it claims to."""
    fake = tmp_path / "halludetect"
    for folder in ("core", "detectors"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "detectors" / "build.py").write_text("X = 1\n")
    (fake / "core" / "bad.py").write_text("def f():\n    from halludetect.detectors.build import X\n")
    monkeypatch.setattr(code_deps, "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    code_deps.explicit_imports.cache_clear()
    try:
        assert upward("halludetect.core.bad") == [
            "halludetect.core.bad (floor 0, core) imports halludetect.detectors.build (floor 5, detectors)"
        ]
        assert upward("halludetect.detectors.build") == []
    finally:
        code_deps.explicit_imports.cache_clear()


DVC_SEAM = "halludetect.runner.dvc_internals"


def dvc_imports(path) -> list[str]:
    """The modules of DVC (or dvc_data) that the file at `path` imports, at any depth of its code."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        found += [n for n in names if n.split(".")[0] in ("dvc", "dvc_data", "dvc_objects")]
    return found


@pytest.mark.parametrize("folder", ["halludetect", "stages", "bench"])
def test_only_the_seam_imports_dvc(folder):
    """Every use of DVC goes through runner/dvc_internals.py, which lists each name with the DVC
    versions it was tested on: a DVC release that renames one is noticed there (issue 53)."""
    seam = code_deps.module_file(DVC_SEAM)
    bad = {
        str(p.relative_to(code_deps.ROOT)): found
        for p in sorted((code_deps.ROOT / folder).rglob("*.py"))
        if p != seam and (found := dvc_imports(p))
    }
    assert not bad, f"{bad}: import DVC's names from {DVC_SEAM} (add them to its NAMES)"


def test_the_runner_is_imported_by_the_experiments_and_the_command_only():
    """`core/` holds what every phase needs; the runner (DVC's side) is for the command line, the
    experiments and bench/ alone."""
    users = {
        name
        for name in modules()
        if modules()[name] != "runner" and any(modules()[dep] == "runner" for dep in imports(name))
    }
    assert {modules()[name] for name in users} <= {"experiments", "cli"}, users

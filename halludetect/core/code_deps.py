"""The code a module runs, read from its imports: dvc.yaml's code deps and the resume fingerprints.

DVC re-runs a stage when a listed dependency changes, and only then. So every stage lists in
`dvc.yaml` exactly the files of ours it runs: a module it runs but does not list could change
results while DVC calls the outputs current; a listed module it never runs makes DVC re-run it
for nothing. `closure` computes that set from the source: the module's imports (at the top of a
file or inside a function, directly or through another module), and the `__init__.py` of every
package on the way, which Python executes on import. One function serves three users:

    python -m halludetect.core.code_deps --write     rewrite dvc.yaml's code deps (`make deps`)
    python -m halludetect.core.code_deps --check     exit 1 naming every stage whose list is stale
    code_digest("stages.generate")                   sha256 per file, for a resume fingerprint

tests/test_pipeline_contract.py fails when dvc.yaml differs from what `--write` would write.

Four rules beyond plain imports: the front door (`halludetect/__init__.py`) is left out, because
it only maps names to modules lazily and runs nothing (a test holds it to that); so is a file that
is only a docstring (most package `__init__.py`), which cannot change a result; a package that
imports its own modules by discovery (`pkgutil.iter_modules(__path__)`, as methods/ does) brings
all of them; and config.py's import of methods/, which only validates params, is not followed
(VALIDATION_ONLY says why).

Plugins (detectors registered from a user's package, methods/plugins.py) are code of every stage
that runs methods/: a stage whose closure holds methods/ gets the closure of each plugin module
too, found without importing anything (the installed entry points of the group
`halludetect.detectors`, and params.yaml's `detectors.<name>.factory`). dvc.yaml can list only
files inside the repository, so a plugin kept in the repository (a folder on the path, or an
editable install of one) is listed and an edit to it re-runs what runs it, as for methods/; a
plugin installed from elsewhere is a library like torch, which DVC does not see (docs/detectors.md
says what to do after upgrading one). The resume fingerprints (`code_digest`) hash every plugin
file wherever it lives.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
from functools import cache
from importlib.machinery import PathFinder
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the directory holding halludetect/ (and stages/ in a checkout)
PACKAGES = ("halludetect", "stages")
FRONT_DOOR = ROOT / "halludetect" / "__init__.py"
# Imports made only to validate params: config.py imports methods/ to check every detector's
# section of params.yaml (and the grid's method names) in every stage, so that a typo stops the
# first stage rather than the training hours later. Those checks can stop a stage but never change
# what it writes, so they are not code of the stage: a stage that uses a method (to build, name or
# analyse a detector) imports methods/ itself and lists them, and adding or editing a method
# never re-runs sampling, dumping or labelling. (The contract test holds every stage declaring
# `detectors` params to running methods/.)
VALIDATION_ONLY = {"halludetect.config": ("halludetect.methods",)}


PLUGIN_GROUP = "halludetect.detectors"  # methods/plugins.py's entry-point group
METHODS_INIT = ROOT / "halludetect" / "methods" / "__init__.py"
_plugin_roots: dict[str, Path] = {}  # a plugin's top-level package -> the directory holding it


def module_file(name: str) -> Path | None:
    """The file of a dotted module name of ours (or of a plugin's package), or None otherwise."""
    top = name.split(".")[0]
    if top in PACKAGES:
        root = ROOT
    elif top in _plugin_roots:
        root = _plugin_roots[top]
    else:
        return None
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _discovers_modules(tree: ast.Module) -> bool:
    """Whether a package's __init__ imports every module of its folder (pkgutil.iter_modules(__path__))."""
    for node in ast.walk(tree):
        called = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
        if called == "iter_modules" and any(isinstance(a, ast.Name) and a.id == "__path__" for a in node.args):
            return True
    return False


@cache
def imports_of(path: Path, package: str) -> frozenset[str]:
    """Our modules that `path` imports anywhere in its body (functions included); `package` is
    the package relative imports resolve against."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
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
        found |= {n for n in names if module_file(n)}
    if path.name == "__init__.py" and _discovers_modules(tree):
        found |= {f"{package}.{p.stem}" for p in path.parent.glob("*.py") if p.name != "__init__.py"}
    return frozenset(found)


def plugin_modules(params_file: Path | None = None) -> list[str]:
    """The modules that define plugin detectors, read without importing anything: the installed
    entry points of PLUGIN_GROUP and params.yaml's detectors.<name>.factory ('module:factory')."""
    import yaml

    found = {ep.value.partition(":")[0].strip() for ep in entry_points(group=PLUGIN_GROUP)}
    path = ROOT / "params.yaml" if params_file is None else Path(params_file)
    try:
        detectors = (yaml.safe_load(path.read_text()) or {}).get("detectors") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        detectors = {}  # no or a broken params file: the stages say what is wrong with it
    if isinstance(detectors, dict):
        found |= {
            str(s["factory"]).partition(":")[0].strip()
            for s in detectors.values()
            if isinstance(s, dict) and "factory" in s
        }
    return sorted(m for m in found if m)


def plugin_root(module: str) -> Path | None:
    """The directory holding a module's top-level package, found on sys.path without running it
    (None: not on the path, which the stages report when they register the plugin)."""
    spec = PathFinder.find_spec(module.split(".")[0])
    if spec is None or spec.origin in (None, "namespace", "built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    return origin.parent.parent if spec.submodule_search_locations else origin.parent


def plugin_files(params_file: Path | None = None) -> list[Path]:
    """Every file the plugin modules run (their import closure within their own packages)."""
    files: set[Path] = set()
    for module in plugin_modules(params_file):
        root = plugin_root(module)
        if root is None or module.split(".")[0] in PACKAGES:
            continue
        _plugin_roots[module.split(".")[0]] = root
        if module_file(module) is not None:
            files |= set(_closure(module))
    return sorted(files)


def closure(module: str, *, plugins: bool = True) -> list[Path]:
    """Every file of ours that runs when `python -m module` runs (or `import module`), sorted; for a
    module that runs methods/, the plugins' files too (those inside the repository: the ones
    dvc.yaml can list; `code_digest` takes them all)."""
    files = _closure(module)
    if plugins and METHODS_INIT in files:
        files = sorted(set(files) | {p for p in plugin_files() if p.is_relative_to(ROOT)})
    return files


def _closure(module: str) -> list[Path]:
    if module_file(module) is None:
        raise ValueError(f"no module '{module}' under {ROOT} (expected one of the packages {', '.join(PACKAGES)})")
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for k in range(1, len(parts) + 1):  # parent packages first: Python runs their __init__
            path = module_file(".".join(parts[:k]))
            if path is None or path in seen:
                continue
            seen.add(path)
            package = ".".join(parts[:k]) if path.name == "__init__.py" else ".".join(parts[: k - 1])
            skip = VALIDATION_ONLY.get(".".join(parts[:k]), ())
            todo += [n for n in imports_of(path, package) if not any(n == s or n.startswith(s + ".") for s in skip)]
    return sorted(p for p in seen - {FRONT_DOOR} if not _runs_nothing(p))


@cache
def _runs_nothing(path: Path) -> bool:
    """A file that is only a docstring (a package's description) cannot change any result: an
    edit to it re-runs nothing."""
    body = ast.parse(path.read_text(), str(path)).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def code_digest(module: str) -> dict[str, str]:
    """sha256 of every file `module` runs, by repository path (a plugin outside the repository: by
    its absolute path): an edit to any of them changes it."""
    files = set(closure(module))
    if METHODS_INIT in files:
        files |= set(plugin_files())
    return {_name(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)}


def _name(path: Path) -> str:
    return relative(path) if path.is_relative_to(ROOT) else str(path)


def code_dirs() -> tuple[str, ...]:
    """The top-level folders of the repository whose files are code deps: ours and in-repo plugins'."""
    extra = {p.relative_to(ROOT).parts[0] for p in plugin_files() if p.is_relative_to(ROOT)}
    return (*PACKAGES, *sorted(extra - set(PACKAGES)))


# ------------------------------------------------------------------------------ dvc.yaml
STAGE = re.compile(r"^  ([\w-]+):\s*(#.*)?$")  # a stage's key, under `stages:`
MODULE = re.compile(r"python -m (stages\.\w+)")


def code_dep_line() -> re.Pattern:
    """A code dep's line in dvc.yaml: a path under one of `code_dirs()`."""
    dirs = "|".join(re.escape(d) for d in code_dirs())
    return re.compile(rf"^(\s+)- ((?:{dirs})/\S+)\s*(#.*)?$")


def stage_body(stage: dict) -> dict:
    """A stage's definition: its `do:` for a `foreach` stage (the transfer stage), else itself."""
    return stage.get("do", stage)


def stage_modules(dvc_yaml: str) -> dict[str, str]:
    """Each stage's `python -m stages.<name>` module."""
    import yaml

    out = {}
    for name, stage in (yaml.safe_load(dvc_yaml).get("stages") or {}).items():
        stage = stage_body(stage)
        match = MODULE.search(stage.get("cmd", ""))
        if not match:
            raise ValueError(f"dvc.yaml: stage '{name}' does not run `python -m stages.<name>`: {stage.get('cmd')!r}")
        out[name] = match.group(1)
    return out


def render(dvc_yaml: str) -> str:
    """dvc.yaml with each stage's code deps replaced by its closure, where its first code dep was;
    every other line (data deps, comments, params, outs) is kept as it is."""
    modules = stage_modules(dvc_yaml)
    code_dep = code_dep_line()
    out, stage, written = [], None, False
    for line in dvc_yaml.splitlines(keepends=True):
        if m := STAGE.match(line):
            stage, written = m.group(1), False
        dep = code_dep.match(line)
        if stage in modules and dep:
            if not written:
                out += [f"{dep.group(1)}- {relative(p)}\n" for p in closure(modules[stage])]
                written = True
            continue
        out.append(line)
    return "".join(out)


def stale_stages(dvc_yaml: str) -> list[str]:
    """Stages whose code deps in `dvc_yaml` differ from their closure (or that list none)."""
    import yaml

    stages = yaml.safe_load(dvc_yaml)["stages"]
    dirs = code_dirs()
    stale = []
    for name, module in stage_modules(dvc_yaml).items():
        listed = sorted(d for d in stage_body(stages[name]).get("deps", []) if d.split("/")[0] in dirs)
        if listed != [relative(p) for p in closure(module)]:
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m halludetect.core.code_deps", description=__doc__.split("\n\n")[0])
    p.add_argument("--dvc-yaml", default=str(ROOT / "dvc.yaml"), help="the pipeline file (default: the repo's)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the code deps of every stage")
    mode.add_argument("--check", action="store_true", help="exit 1 naming the stages whose code deps are stale")
    mode.add_argument("--module", help="print the files one module runs, one per line")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError, SyntaxError) as e:  # a bad name, a missing file, a module that does not parse
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.module:
        print("\n".join(relative(f) for f in closure(args.module)))
        return 0
    path = Path(args.dvc_yaml)
    text = path.read_text()
    if args.check:
        if stale := stale_stages(text):
            print(f"{path}: stale code deps in {', '.join(stale)}: run `make deps`", file=sys.stderr)
            return 1
        return 0
    new = render(text)
    if new != text:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new)
        tmp.replace(path)
    print(f"{path}: code deps of {len(stage_modules(new))} stages written" + ("" if new != text else " (unchanged)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import contextlib
import functools
import hashlib
import re
import sys
from functools import cache
from importlib.machinery import PathFinder
from pathlib import Path

from halludetect.core.registry import group, installed

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
# The scores with nothing to train (methods/scores.py) are detectors of grid.detectors: the train and
# evaluate stages run for them too, handing them over by name to stages/<family>_score.py
# (stages/common.py hand_over). So a score's digest of those stages is the stage's own file (its
# arguments and the hand-over run), the code of the module it hands over to and of the module that
# computes the score (its declaration's `compute`); of methods/'s discovered files it follows
# scores.py alone. A trained method's digest holds none of it: an edit to the training re-runs no
# score, an edit to p(True) no trained method and no other score, the bundle's export no score's
# train stage.
HAND_OVER = {"stages.train": "stages.train_score", "stages.evaluate": "stages.evaluate_score"}
SCORES_FILE = "halludetect.methods.scores"


# One pass over the code (the code stage's digests, a --check): the files cannot change under it, so
# the answers of the readers below are kept for its length (`one_pass`) instead of re-reading
# params.yaml, the entry points and methods/ for each of the ~130 closures (3.7 s -> well under 1 s).
# Outside a pass every call reads afresh: a test or a session may edit files between two calls.
_pass_memo: dict | None = None


@contextlib.contextmanager
def one_pass():
    global _pass_memo
    outer = _pass_memo
    _pass_memo = {} if outer is None else outer
    try:
        yield
    finally:
        _pass_memo = outer


def _per_pass(fn):
    @functools.wraps(fn)
    def kept(*args, **kwargs):
        if _pass_memo is None:
            return fn(*args, **kwargs)
        key = (fn.__name__, args, tuple(sorted(kwargs.items())))
        if key not in _pass_memo:
            _pass_memo[key] = fn(*args, **kwargs)
        return _pass_memo[key]

    return kept


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


def imports_of(path: Path, package: str) -> frozenset[str]:
    """Our modules that `path` imports anywhere in its body (functions included), and those its
    package's __init__ imports by discovery; `package` is the package relative imports resolve against."""
    return explicit_imports(path, package) | discovered(path, package)


@cache
def explicit_imports(path: Path, package: str) -> frozenset[str]:
    """Our modules that `path` names in an import statement anywhere in its body."""
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
    return frozenset(found)


@_per_pass
def discovered(path: Path, package: str) -> frozenset[str]:
    """The modules a package's __init__ imports by discovery (every module of its folder), if it does."""
    if path.name != "__init__.py" or not _discovers_modules(ast.parse(path.read_text(), str(path))):
        return frozenset()
    return frozenset(f"{package}.{p.stem}" for p in path.parent.glob("*.py") if p.name != "__init__.py")


@_per_pass
def plugin_modules(params_file: Path | None = None) -> list[str]:
    """The modules that define plugin detectors, read without importing anything: the installed
    entry points of PLUGIN_GROUP and params.yaml's detectors.<name>.factory ('module:factory')."""
    found = {ep.value.partition(":")[0].strip() for ep in installed(PLUGIN_GROUP)}
    found |= set(_params_factories(params_file).values())
    return sorted(m for m in found if m)


@_per_pass
def _params_section(key: str, params_file: Path | None = None) -> dict:
    """params.yaml's mapping `key` as written, or {} (no or a broken params file: the stages say what
    is wrong with it)."""
    from halludetect.core import yaml12

    path = ROOT / "params.yaml" if params_file is None else Path(params_file)
    try:
        section = (yaml12.load(path.read_text()) or {}).get(key) or {}
    except (OSError, yaml12.YAMLError, AttributeError):
        return {}
    return section if isinstance(section, dict) else {}


@_per_pass
def _params_factories(params_file: Path | None = None) -> dict[str, str]:
    """{method name: module} of params.yaml's detectors.<name>.factory keys."""
    detectors = _params_section("detectors", params_file)
    return {
        str(name): str(s["factory"]).partition(":")[0].strip()
        for name, s in detectors.items()
        if isinstance(s, dict) and "factory" in s
    }


def plugin_root(module: str) -> Path | None:
    """The directory holding a module's top-level package, found on sys.path without running it
    (None: not on the path, which the stages report when they register the plugin)."""
    spec = PathFinder.find_spec(module.split(".")[0])
    if spec is None or spec.origin in (None, "namespace", "built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    return origin.parent.parent if spec.submodule_search_locations else origin.parent


@_per_pass
def plugin_files(params_file: Path | None = None, *, only: str | None = None) -> list[Path]:
    """Every file the plugin modules run (their import closure within their own packages); with
    `only`, those of that method's plugin (none for a built-in method)."""
    files: set[Path] = set()
    modules = plugin_modules(params_file)
    if only is not None:
        mine = plugin_methods(params_file).get(only) if only not in builtin_methods() else None
        modules = [m for m in modules if m == mine]
    for module in modules:
        root = plugin_root(module)
        if root is None or module.split(".")[0] in PACKAGES:
            continue
        _plugin_roots[module.split(".")[0]] = root
        if module_file(module) is not None:
            # one plugin's files: what it imports of methods/, not every method file by discovery
            files |= set(_closure(module, frozenset() if only is not None else None))
    return sorted(files)


def closure(module: str, *, plugins: bool = True, method: str | None = None) -> list[Path]:
    """Every file of ours that runs when `python -m module` runs (or `import module`), sorted; for a
    module that runs methods/, the plugins' files too (those inside the repository: the ones
    dvc.yaml can list; `code_digest` takes them all).

    With `method`, what that one method's run of the module depends on: methods/ imports every
    method's file by discovery, but a method's results depend only on its own file (and what that
    imports); the other methods' files only register other names. So an edit to methods/sep.py
    re-runs SEP's stages and no other method's (the code stage writes one digest per method)."""
    if method is not None and method in builtin_scores():
        return score_closure(module, method)
    keep = None if method is None else method_modules(method)
    files = _closure(module, keep)
    if plugins and METHODS_INIT in files:
        mine = plugin_files(only=method) if method is not None else plugin_files()
        files = sorted(set(files) | {p for p in mine if p.is_relative_to(ROOT)})
    return files


@_per_pass
def _closure(module: str, keep: frozenset[str] | None = None) -> list[Path]:
    """`keep`: of the modules a package imports by discovery, follow only these (None: all)."""
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
            found = discovered(path, package)
            names = explicit_imports(path, package) | (found if keep is None else found & keep)
            if ".".join(parts[:k]) not in REGISTRY_VALIDATION_ONLY:
                modules, files = registry_deps(path)
                names |= modules
                seen.update(files)
            todo += [n for n in names if not any(n == s or n.startswith(s + ".") for s in skip)]
    return sorted(p for p in seen - {FRONT_DOOR} if not _runs_nothing(p))


# ------------------------------------------------------------------------------ the registry's targets
REGISTRY_FILE = ROOT / "halludetect" / "core" / "registry.py"
# config.py resolves a dataset's format file only to check its preset (does it need a `path`?): that can
# stop a stage but not change what it writes, as for its import of methods/ (VALIDATION_ONLY).
REGISTRY_VALIDATION_ONLY = {"halludetect.config"}


@_per_pass
def registry_builtins() -> dict[str, dict[str, str]]:
    """core/registry.py's BUILTINS, read from its source (no import)."""
    for node in ast.parse(REGISTRY_FILE.read_text(), str(REGISTRY_FILE)).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "BUILTINS" and node.value is not None:
            return ast.literal_eval(node.value)
    raise ValueError(f"{REGISTRY_FILE} has no BUILTINS literal")


@_per_pass
def kind_deps(kind: str) -> tuple[frozenset[str], frozenset[Path]]:
    """The modules and files that resolving any name of `kind` may run: each built-in's module, or its
    format file and the reader that file names; and the installed plugins' modules that are ours."""
    modules, files = set(), set()
    for target in registry_builtins().get(kind, {}).values():
        if target.endswith(".yaml"):
            path = ROOT / "halludetect" / target
            files.add(path)
            reader = _format_reader(path)
            if reader:
                modules.add(reader.partition(":")[0])
        else:
            modules.add(target.partition(":")[0])
    modules |= {ep.value.partition(":")[0].strip() for ep in installed(group(kind))}
    if kind == "dataset":  # a preset's own format may name a reader of the repository's (params.yaml)
        modules |= set(_params_readers())
    return frozenset(m for m in modules if module_file(m)), frozenset(p for p in files if p.is_file())


@_per_pass
def _params_readers(params_file: Path | None = None) -> list[str]:
    """The modules of params.yaml's datasets.<name>.format.reader keys ('module:function')."""
    readers = [
        p["format"].get("reader")
        for p in _params_section("datasets", params_file).values()
        if isinstance(p, dict) and isinstance(p.get("format"), dict)
    ]
    return sorted({str(r).partition(":")[0].strip() for r in readers if r})


def _format_reader(path: Path) -> str | None:
    from halludetect.core import yaml12

    try:
        data = yaml12.load(path.read_text()) or {}
    except (OSError, yaml12.YAMLError):
        return None  # the stage names what is wrong with it
    return data.get("reader") if isinstance(data, dict) else None


@cache
def _resolved_kinds(path: Path) -> frozenset[str]:
    """The kinds a file resolves by name: calls `resolve("<kind>", ...)` with a literal kind."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "resolve"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return frozenset(found)


def registry_deps(path: Path) -> tuple[frozenset[str], frozenset[Path]]:
    """What a file runs through core/registry.py: the targets of every kind it resolves."""
    if path.suffix != ".py":
        return frozenset(), frozenset()
    modules: set[str] = set()
    files: set[Path] = set()
    for kind in _resolved_kinds(path):
        m, f = kind_deps(kind)
        modules |= m
        files |= f
    return frozenset(modules), frozenset(files)


# ------------------------------------------------------------------------------ one method's code
METHOD_CALL = "Method"  # methods/<file>.py registers a method by `Method("<name>", ...)`


@_per_pass
def builtin_methods() -> dict[str, str]:
    """{method name: the module of methods/ that declares it}, read from the source (no import): the
    first argument of each `Method(...)` call in a file of methods/ (spec.py and plugins.py declare
    none)."""
    found: dict[str, str] = {}
    for path in sorted(METHODS_INIT.parent.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == METHOD_CALL
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.setdefault(node.args[0].value, f"halludetect.methods.{path.stem}")
    return found


@_per_pass
def plugin_methods(params_file: Path | None = None) -> dict[str, str]:
    """{method name: module} of the plugins (entry point names and params keys), without importing."""
    found = {ep.name: ep.value.partition(":")[0].strip() for ep in installed(PLUGIN_GROUP)}
    for name, module in _params_factories(params_file).items():
        found.setdefault(name, module)
    return found


SCORE_CALL = (
    "Score"  # methods/scores.py declares a score by `Score("<name>", display, needs, "<module:function>", ...)`
)


@_per_pass
def builtin_scores() -> dict[str, str]:
    """{score name: the module its declaration's `compute` names}, read from methods/scores.py's source."""
    path = module_file(SCORES_FILE)
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == SCORE_CALL:
            given = dict(enumerate(node.args)) | {k.arg: k.value for k in node.keywords}
            name, compute = given.get(0, given.get("name")), given.get(3, given.get("compute"))
            if not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in (name, compute)):
                raise ValueError(
                    f"{path}:{node.lineno}: a Score's name and compute are string literals (the code stage reads them)"
                )
            found[name.value] = compute.value.partition(":")[0]
    return found


def score_closure(module: str, score: str) -> list[Path]:
    """What a score's run of a train or evaluate stage module depends on (HAND_OVER)."""
    if module not in HAND_OVER:
        raise ValueError(f"{module} runs no score: only {', '.join(HAND_OVER)} hand one over")
    keep = frozenset({SCORES_FILE})
    own = set(_closure(HAND_OVER[module], keep)) | set(_closure(builtin_scores()[score], keep))
    return sorted(own | {module_file(module)})


def all_methods() -> dict[str, str]:
    """Every method a digest is written for: {name: module}, built-ins and plugins."""
    return {**plugin_methods(), **builtin_methods()}


def method_modules(method: str) -> frozenset[str]:
    """The modules of methods/ a method's results depend on: its own declaring module (a plugin: none
    of methods/, its own package is added by closure())."""
    builtin = builtin_methods()
    if method in builtin:
        return frozenset({builtin[method]})
    if method in plugin_methods():
        return frozenset()
    raise ValueError(f"no method '{method}': neither a file of halludetect/methods/ nor a plugin declares it")


@cache
def _runs_nothing(path: Path) -> bool:
    """A file that is only a docstring (a package's description) cannot change any result: an
    edit to it re-runs nothing."""
    if path.suffix != ".py":
        return False  # a data file a stage reads (a dataset format)
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


# ------------------------------------------------------------------------------ the code stage
# dvc.yaml lists no code file in any stage but one: the `code` stage depends on the code folders
# (one entry each in dvc.lock) and writes a small digest file per stage module, and per method for
# the modules that run methods/ (`<out>/<module>.txt`, `<out>/<module>/<method>.txt`: the sha256 of
# every file of that closure). Every other stage lists the one digest file of its module (of its
# method, where its matrix has one), so its entry in dvc.lock is one dep instead of ~35 files, and
# an edit re-runs exactly the stages whose digest changed: the code stage re-runs on any edit (a
# second), and DVC compares the digest files' hashes, which change only for the closures that hold
# the edited file.
STAGES_DIR = ROOT / "stages"
NOT_STAGES = (
    "__init__",
    "common",
    "code",
    "train_score",
    "evaluate_score",
)  # modules of stages/ that are no stage with a digest


def stage_module_names() -> list[str]:
    """Every stage module that gets a digest: stages/<name>.py but the plumbing and the code stage."""
    return sorted(f"stages.{p.stem}" for p in STAGES_DIR.glob("*.py") if p.stem not in NOT_STAGES)


def runs_methods(module: str) -> bool:
    return METHODS_INIT in _closure(module)


def digest_text(files: list[Path]) -> str:
    """One line per file: its sha256 and its repository path (files outside the repository, a
    plugin installed elsewhere, are left out: DVC tracks no library, and an absolute path would make
    the digest differ between machines)."""
    inside = [p for p in files if p.is_relative_to(ROOT)]
    return "".join(f"{_sha256(p)}  {relative(p)}\n" for p in inside)


@_per_pass
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests() -> dict[str, str]:
    """{relative path under the code stage's output: content} for every stage module and method."""
    with one_pass():
        return _digests()


def _digests() -> dict[str, str]:
    out = {}
    methods = sorted(all_methods())
    for module in stage_module_names():
        short = module.split(".", 1)[1]
        out[f"{short}.txt"] = digest_text(closure(module))
        if runs_methods(module):
            for m in methods:
                out[f"{short}/{m}.txt"] = digest_text(closure(module, method=m))
        if module in HAND_OVER:
            for score in sorted(builtin_scores()):
                out[f"{short}/{score}.txt"] = digest_text(score_closure(module, score))
    return out


def write_digests(out_dir: str | Path) -> dict[str, str]:
    """Write `digests()` under `out_dir` (atomically, as one directory)."""
    from halludetect.core.atomic_io import atomic_path

    found = digests()
    with atomic_path(out_dir, is_dir=True) as tmp:
        for rel, text in found.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
    return found


# ------------------------------------------------------------------------------ dvc.yaml
MODULE = re.compile(r"python -m (stages\.\w+)")
CODE_STAGE = "code"
STAGE_KEY = re.compile(r"^  ([\w-]+):\s*(#.*)?$")  # a stage's key, under `stages:`
FIELD_KEY = re.compile(r"^    (\w+):")  # a stage's field: cmd, deps, params, outs
DIGEST = re.compile(r"^(?P<dir>.+)/(?P<module>\w+)(?:/(?P<method>\$\{item\.method\}))?\.txt$")


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


def code_out(stages: dict) -> str:
    """The code stage's output directory, as dvc.yaml writes it."""
    outs = stage_body(stages.get(CODE_STAGE) or {}).get("outs") or []
    if len(outs) != 1:
        raise ValueError(f"dvc.yaml: the stage '{CODE_STAGE}' must have one output, the digests' directory")
    return str(outs[0])


def stage_problems(dvc_yaml: str) -> dict[str, str]:
    """{stage: what is wrong with its code deps}: the code stage must list exactly `code_dirs()`; every
    other stage exactly one digest of the code stage's output, of its own module, per method where
    its matrix has a method and its module runs methods/, and no code file."""
    with one_pass():
        return _stage_problems(dvc_yaml)


def _stage_problems(dvc_yaml: str) -> dict[str, str]:
    import yaml

    stages = yaml.safe_load(dvc_yaml)["stages"]
    dirs, out = code_dirs(), code_out(stages)
    problems = {}
    for name, module in stage_modules(dvc_yaml).items():
        body = stage_body(stages[name])
        deps = [str(d).split("#")[0].strip() for d in body.get("deps", [])]
        if name == CODE_STAGE:
            if sorted(deps) != sorted(dirs):
                problems[name] = f"lists {deps}, expected the code folders {list(dirs)}: run `make deps`"
            continue
        code = [d for d in deps if d.split("/")[0] in dirs]
        if code:
            problems[name] = f"lists code files {code}: a stage lists its code stage digest, not files"
            continue
        digests = [d for d in deps if d.startswith(out + "/")]
        short = module.split(".", 1)[1]
        per_method = "method" in (stages[name].get("matrix") or {}) and runs_methods(module)
        want = f"{out}/{short}/${{item.method}}.txt" if per_method else f"{out}/{short}.txt"
        if digests != [want]:
            problems[name] = f"lists the code digests {digests}, expected [{want}]"
    return problems


def render(dvc_yaml: str) -> str:
    """dvc.yaml with the code stage's deps written as `code_dirs()` (an in-repository plugin's folder
    joins them); every other line is kept as it is."""
    lines, out, in_code, in_deps, written = dvc_yaml.splitlines(keepends=True), [], False, False, False
    for line in lines:
        if m := STAGE_KEY.match(line):
            in_code, in_deps = m.group(1) == CODE_STAGE, False
        elif in_code and (m := FIELD_KEY.match(line)):
            in_deps = m.group(1) == "deps"
        elif in_code and in_deps and line.strip().startswith("- "):
            if not written:
                out += [f"      - {d}\n" for d in code_dirs()]
                written = True
            continue
        out.append(line)
    return "".join(out)


def stale_stages(dvc_yaml: str) -> list[str]:
    return sorted(stage_problems(dvc_yaml))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m halludetect.core.code_deps", description=__doc__.split("\n\n")[0])
    p.add_argument("--dvc-yaml", default=str(ROOT / "dvc.yaml"), help="the pipeline file (default: the repo's)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the code deps of every stage")
    mode.add_argument("--check", action="store_true", help="exit 1 naming the stages whose code deps are stale")
    mode.add_argument("--module", help="print the files one module runs, one per line")
    p.add_argument("--method", help="with --module: the files one method's run of it depends on")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError, SyntaxError) as e:  # a bad name, a missing file, a module that does not parse
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.module:
        print("\n".join(relative(f) for f in closure(args.module, method=args.method)))
        return 0
    path = Path(args.dvc_yaml)
    text = path.read_text()
    if args.check:
        if problems := stage_problems(text):
            for stage, why in problems.items():
                print(f"{path}: stage '{stage}' {why}", file=sys.stderr)
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

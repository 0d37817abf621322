"""One registry of the parts a params key names by a word: judge and NLI backends, samplers, dataset
loaders. Each kind lists its built-in names as lazy targets, and takes more from an entry-point group:

    kind      params key               entry-point group        a target
    judge     judge.backend            halludetect.judges       "module:object", a factory of a judge
    nli       cluster.backend          halludetect.nli          "module:object", a factory of an NLI
    sampler   generate.backend         halludetect.samplers     "module:object", an opener of a sampler
    dataset   datasets.<name>.loader   halludetect.datasets     a format file (qa/formats/*.yaml: data),
                                                                or "module:object", a loader function

Nothing here imports a part. config.py checks a params name against `names(kind)` (the built-ins and
the installed entry points' names, read from package metadata) in every stage, before any work; the
stage that runs a part calls `resolve(kind, name)`, which imports it then (or reads its format file).
Unknown names get the did-you-mean errors of core/lookup.py. A target is a string so that config's
import closure, which every stage has, does not hold every backend and their libraries; the code
deps still follow it: code_deps.py reads `BUILTINS` from this file's source, and a module that calls
`resolve("<kind>", ...)` runs that kind's built-ins (their modules, and a format file and the loader
it names), so they are its code deps, as an import would make them.

Detection methods have their own registry (methods/: one file declares one, by discovery, and plugins
come from the group `halludetect.detectors`), because a method also declares its params section and
traits that config builds the params from.
"""

from __future__ import annotations

import importlib
import sys
from functools import cache
from importlib.metadata import EntryPoints, entry_points
from pathlib import Path
from typing import Any

from halludetect.core.lookup import UnknownName, suggest

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # halludetect/: format files are named relative to it

# kind -> {name: target}. A target ending in .yaml is a file of this package (data); any other is
# "module:object". code_deps.py reads this literal from the source: keep it a plain dict of strings.
BUILTINS: dict[str, dict[str, str]] = {
    "judge": {
        "match": "halludetect.labels.judges.match:MatchJudge",
        "openai": "halludetect.labels.judges.openai:OpenAIJudge",
    },
    "nli": {
        "exact": "halludetect.labels.nli.backends:ExactNLI",
        "hf": "halludetect.labels.nli.backends:HFNLI",
        "openai": "halludetect.labels.nli.backends:OpenAINLI",
    },
    "sampler": {
        "hf": "halludetect.lm.samplers:open_hf",
        "completions": "halludetect.lm.samplers:open_completions",
    },
    "dataset": {
        "file": "qa/formats/file.yaml",
        "world": "qa/formats/file.yaml",
        "trivia_qa": "qa/formats/trivia_qa.yaml",
        "squad": "qa/formats/squad.yaml",
        "nq": "qa/formats/nq.yaml",
        "bioasq": "qa/formats/bioasq.yaml",
        "truthful_qa": "qa/formats/truthful_qa.yaml",
        "halueval_qa": "qa/formats/halueval_qa.yaml",
        "svamp": "qa/formats/svamp.yaml",
    },
}

# kind -> how an error names it (the params key that chose the name)
LABELS = {
    "judge": "judge backend (judge.backend)",
    "nli": "NLI backend (cluster.backend)",
    "sampler": "generate backend (generate.backend)",
    "dataset": "dataset loader (datasets.<name>.loader)",
}


class TargetError(UnknownName):
    """A registered target that cannot be loaded: its module, object or file is missing."""


def group(kind: str) -> str:
    return f"halludetect.{kind}s" if kind != "nli" else "halludetect.nli"


def _kind(kind: str) -> dict[str, str]:
    if kind not in BUILTINS:
        raise ValueError(f"no registry kind '{kind}'; kinds: {', '.join(BUILTINS)}")
    return BUILTINS[kind]


def installed(group_name: str) -> EntryPoints:
    """The installed entry points of `group_name`. Reading them scans every distribution's metadata
    (10 ms with this environment's packages), and config checks a name a dozen times per process, so
    the scan is kept per sys.path: a folder put on the path later (a test's fake distribution) is
    scanned again."""
    return _installed(tuple(sys.path)).select(group=group_name)


@cache
def _installed(path: tuple[str, ...]) -> EntryPoints:
    return entry_points()


def plugins(kind: str) -> dict[str, str]:
    """{name: target} of the installed entry points of the kind's group (no import). A plugin may not
    take a built-in's name: which of the two a params word meant would depend on what is installed."""
    builtins = _kind(kind)
    found = {}
    for ep in installed(group(kind)):
        if ep.name in builtins:
            dist = f" (package {ep.dist.name})" if getattr(ep, "dist", None) is not None else ""
            raise TargetError(
                f"the entry point '{ep.name} = {ep.value}' of group {group(kind)}{dist} takes the name of the "
                f"built-in {LABELS.get(kind, kind)} '{ep.name}': rename it in that package's entry points"
            )
        found[ep.name] = ep.value.strip()
    return found


def targets(kind: str) -> dict[str, str]:
    """Every name of the kind (the built-ins and the installed plugins) and its target."""
    return {**plugins(kind), **_kind(kind)}


def names(kind: str) -> list[str]:
    return sorted(targets(kind))


def check(kind: str, name: str) -> None:
    """Raise the did-you-mean error when `name` is not a registered name of `kind`."""
    if name not in targets(kind):
        raise UnknownName(f"unknown {LABELS.get(kind, kind)} '{name}'{suggest(name, targets(kind))}")


def resolve(kind: str, name: str) -> Any:
    """The part `name` of `kind`: the object its "module:object" target names (imported now), or the
    content of its format file (a mapping, read as YAML 1.2)."""
    check(kind, name)
    return load_target(targets(kind)[name], f"{LABELS.get(kind, kind)} '{name}'")


def load_target(target: str, what: str) -> Any:
    """A "module:object" target's object, or a package data file's (.yaml) content."""
    if target.endswith(".yaml"):
        return _read_format(str(PACKAGE_DIR / target) if not Path(target).is_absolute() else target, what)
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise TargetError(f"{what}: target '{target}' is not 'module:object' (nor a .yaml file)")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise TargetError(f"{what}: cannot import '{module}' ({e}); is its package installed?") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{what}: module '{module}' has no '{attr}'")
        obj = getattr(obj, part)
    return obj


@cache
def _read_cached(path: str, mtime_ns: int) -> Any:
    from halludetect.core import yaml12

    return yaml12.load(Path(path).read_text())


def _read_format(path: str, what: str) -> Any:
    from halludetect.core import yaml12

    p = Path(path)
    if not p.is_file():
        raise TargetError(f"{what}: its format file {p} does not exist")
    try:
        return _read_cached(str(p), p.stat().st_mtime_ns)
    except yaml12.YAMLError as e:
        raise TargetError(f"{what}: {p} is not valid YAML ({e})") from None

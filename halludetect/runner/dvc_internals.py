"""Every name of DVC (and of dvc_data) that halludetect uses, in one place, with the DVC versions
they were tested against.

DVC documents a Python API (`dvc.api`, `dvc.repo.Repo`); the runner goes further: it replaces DVC's
reproduce loop, stage runner and lock writer at run time (parallel_repro.py, dvc_lock.py), plans a
run with DVC's own collection, plan and run-cache lookup (repro.py), and the experiments read exp
show's table and ref namespaces. None of that is DVC's promise, so every such name is looked up
here, by name (`NAMES`), and nowhere else (tests/test_layout.py fails where another module of
halludetect/, stages/ or bench/ imports DVC). A DVC release that renames one is then noticed:

- `TESTED` is the range of DVC these names were checked on: the lowest pyproject.toml allows
  (CI's .ci/dvc-range runs the DVC tests there) and the newest, requirements.lock's pin
  (tests/test_lock.py holds the two to those files);
- the first name used from a DVC outside that range prints one warning saying so;
- a name the installed DVC lacks raises `Missing` naming it and the DVC version; the runner then
  falls back to DVC's own behaviour (its lock writer, one stage at a time, "it runs" in a plan) and
  says which, and `missing()` lists every such name (a test fails on any, at both ends of the range).

    from halludetect.runner.dvc_internals import Repo, parse_args   # a name, imported when first used
    from halludetect.runner import dvc_internals; dvc_internals.missing()
"""

from __future__ import annotations

import importlib
import warnings

TESTED = ("3.63.0", "3.67.1")  # (lowest, newest): pyproject's floor, requirements.lock's pin

# name -> (module, attribute; None: the module itself). Grouped by who uses them.
NAMES: dict[str, tuple[str, str | None]] = {
    # DVC's documented API (experiments/, runner/dag.py, bench/)
    "Repo": ("dvc.repo", "Repo"),
    "DVCFileSystem": ("dvc.api", "DVCFileSystem"),
    # the CLI: `python -m halludetect.runner.dvc_lock` is DVC's CLI; repro.py and cli/exp.py parse its arguments
    "main": ("dvc.cli", "main"),
    "parse_args": ("dvc.cli", "parse_args"),
    "PROJECT_FILE": ("dvc.dvcfile", "PROJECT_FILE"),
    # errors runner/dag.py turns into one line
    "DvcException": ("dvc.exceptions", "DvcException"),
    "NotDvcRepoError": ("dvc.exceptions", "NotDvcRepoError"),
    "SCMError": ("dvc.scm", "SCMError"),
    "YAMLValidationError": ("dvc.utils.strictyaml", "YAMLValidationError"),
    # repro.py's plan: DVC's stage collection and plan, the run cache's lookup, an output's hash
    "collect_stages": ("dvc.repo.reproduce", "collect_stages"),
    "get_active_graph": ("dvc.repo.reproduce", "get_active_graph"),
    "plan_repro": ("dvc.repo.reproduce", "plan_repro"),
    "StageCache": ("dvc.stage.cache", "StageCache"),
    "_can_hash": ("dvc.stage.cache", "_can_hash"),
    "_get_cache_hash": ("dvc.stage.cache", "_get_cache_hash"),
    "to_single_stage_lockfile": ("dvc.stage.serialize", "to_single_stage_lockfile"),
    "HashInfo": ("dvc_data.hashfile.hash_info", "HashInfo"),
    "Meta": ("dvc_data.hashfile.meta", "Meta"),
    "Tree": ("dvc_data.hashfile.tree", "Tree"),
    # `-S` values as `dvc exp run` applies them (repro.py, experiments/overrides.py)
    "to_path_overrides": ("dvc.utils.cli_parse", "to_path_overrides"),
    "apply_overrides": ("dvc.utils.hydra", "apply_overrides"),
    "get_hydra_sweeps": ("dvc.utils.hydra", "get_hydra_sweeps"),
    "to_hydra_overrides": ("dvc.utils.hydra", "to_hydra_overrides"),
    # parallel_repro.py: the modules whose functions it replaces, and what it calls of them
    "reproduce": ("dvc.repo.reproduce", None),
    "stage_run": ("dvc.stage.run", None),
    "StageCmdFailedError": ("dvc.stage.exceptions", "StageCmdFailedError"),
    "_make_cmd": ("dvc.stage.run", "_make_cmd"),
    "Tqdm": ("dvc.progress", "Tqdm"),
    # dvc_lock.py: the module whose lock writer it replaces, DVC's YAML dumper; bench/ reads and writes locks with it
    "dvcfile": ("dvc.dvcfile", None),
    "yaml": ("dvc.utils.serialize._yaml", None),
    "load_yaml": ("dvc.utils.serialize", "load_yaml"),
    "modify_yaml": ("dvc.utils.serialize", "modify_yaml"),
    "dump_yaml": ("dvc.utils.serialize", "dump_yaml"),
    "dumps_yaml": ("dvc.utils.serialize", "dumps_yaml"),
    "ParamsDependency": ("dvc.dependency.param", "ParamsDependency"),
    # experiments/: exp show's table and the API's conversion of its values, the refs' namespaces
    "tabulate": ("dvc.repo.experiments.show", "tabulate"),
    "_postprocess": ("dvc.api.experiments", "_postprocess"),
    "EXPS_NAMESPACE": ("dvc.repo.experiments.refs", "EXPS_NAMESPACE"),
    "ITER_SKIP_NAMESPACES": ("dvc.repo.experiments.refs", "ITER_SKIP_NAMESPACES"),
    "STASHES": ("dvc.repo.experiments.refs", "STASHES"),
}

# What the runner reads or replaces inside those modules and classes (a dotted path below a name).
MEMBERS = (
    "reproduce._reproduce",
    "reproduce._reproduce_stage",
    "reproduce._get_upstream_downstream_nodes",
    "reproduce.handle_error",
    "reproduce._raise_error",
    "reproduce.logger",
    "stage_run.unlocked_repo",
    "stage_run._run",
    "dvcfile.modify_yaml",
    "dvcfile.Lockfile.dump_stages",
    "yaml._dump",
    "yaml.modify_yaml",
    "StageCache._get_cache_dir",
    "StageCache._load_cache",
    "StageCache._create_stage",
)


class Missing(AttributeError):
    """A DVC name this module lists is not in the installed DVC."""


def version() -> str:
    from importlib.metadata import version as installed

    return installed("dvc")


def tested() -> bool:
    """Whether the installed DVC lies in `TESTED` (its newest minor release's patches count as tested)."""
    from packaging.version import Version

    v, (low, high) = Version(version()), TESTED
    newest = Version(high)
    return Version(low) <= v and (v.major, v.minor) <= (newest.major, newest.minor)


_WARNED = False


def _check() -> None:
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    if not tested():
        warnings.warn(
            f"DVC {version()} is outside the versions halludetect's runner was tested with ({TESTED[0]} to "
            f"{TESTED[1]}); where one of the DVC internals it uses is gone, it falls back to DVC's own "
            "behaviour and says so (halludetect/runner/dvc_internals.py)",
            stacklevel=3,
        )


def get(name: str):
    """The DVC object `name` (a key of NAMES, or a dotted MEMBERS path); `Missing` where DVC lacks it."""
    _check()
    head, *rest = name.split(".")
    if head not in NAMES:
        raise KeyError(f"{head}: not a DVC name halludetect/runner/dvc_internals.py lists")
    module, attr = NAMES[head]
    try:
        obj = importlib.import_module(module)
        for part in ([attr] if attr else []) + rest:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        where = f"{module}.{attr}" if attr else module
        raise Missing(f"DVC {version()} has no {where}{''.join('.' + r for r in rest)} ({e})") from None
    return obj


def missing() -> list[str]:
    """Every name of NAMES and MEMBERS the installed DVC lacks (each with DVC's version)."""
    out = []
    for name in (*NAMES, *MEMBERS):
        try:
            get(name)
        except Missing as e:
            out.append(str(e))
    return out


def __getattr__(name: str):  # `from halludetect.runner.dvc_internals import Repo`: looked up when imported
    if name in NAMES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Detectors registered from outside halludetect: a user's own package, without editing ours.

Two ways in, both naming a callable `module:factory` that takes no argument and returns a `Method`
(spec.py) whose name is the one it is registered under:

  entry point   [project.entry-points."halludetect.detectors"] wide_max = "my_detectors.wide:make"
                in the package's pyproject.toml: once installed, the method exists everywhere,
                in every stage and in `halludetect score`;
  params key    detectors.wide_max.factory: my_detectors.wide:make in params.yaml, for a module
                on the path (a folder of the repository, say): the stages register it when they
                read params.yaml (config.py), `halludetect score` does not read params.

Either way the method is registered with `family="yours"` and its `Origin`, which detector files
and bundles record: a bundle of a params-key method scored outside the DAG names the factory to
register first (`load_factory`), and nothing is imported because a file says so.

Every failure is one `PluginError` naming the entry point or the params key and the fix: a module
that does not exist or fails to import, a factory that is missing, not callable, raises, returns
something that is not a `Method` or a method of another name, or a name already taken. A network
that is not an `nn.Module` is refused where it is built (detectors/build.py), before training, and
one whose output is not one finite score per bag on its first training batch, or at score time
(`build.check_scores`).
"""

from __future__ import annotations

import importlib
import re
import typing
from dataclasses import replace

from halludetect.core.errors import UserError
from halludetect.core.registry import installed
from halludetect.core.sections import Section
from halludetect.methods.spec import METHODS, SCORES, Fit, Method, Origin, Reads, register, registered

GROUP = "halludetect.detectors"
NAME = re.compile(r"[a-z][a-z0-9_]*")  # a params key and a DVC stage-name part: no dots, no dashes
_entry_points_loaded = False
# Method's flags before what a method reads and how it is fitted were declarations of their own
# (methods/spec.py: Reads, Fit): how a factory written for them says the same now.
FORMER_FLAGS = {
    "reads_p_sem": "write reads=Reads(p_sem=True) (halludetect.methods.spec.Reads)",
    "per_question": "write reads=Reads(question=True) (halludetect.methods.spec.Reads)",
    "positions": "write reads=Reads(positions=(...)) (halludetect.methods.spec.Reads)",
    "min_tokens": "write reads=Reads(min_tokens=N) (halludetect.methods.spec.Reads)",
    "target": "write fit=SE_PROBE for the semantic-entropy target (halludetect.methods.spec)",
}


class PluginError(UserError, ValueError):
    """A plugin that cannot be registered; the message names where it was declared and the fix."""


def _factory(spec: str, where: str, fix: str) -> Method:
    """Import `module`, call `factory()` of a 'module:factory' spec, and check what it returned."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise PluginError(f"{where}: '{spec}' is not 'module:factory' (e.g. my_detectors.wide:make); {fix}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise PluginError(
                f"{where}: no module '{module_name}' on the Python path; install the package that has "
                f"it, or put it on PYTHONPATH ({fix})"
            ) from None
        raise PluginError(f"{where}: importing '{module_name}' failed: {type(e).__name__}: {e}; {fix}") from None
    except Exception as e:  # any error while the user's module runs
        raise PluginError(f"{where}: importing '{module_name}' failed: {type(e).__name__}: {e}; {fix}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{where}: '{module_name}' has no '{attr}'; {fix}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{where}: '{spec}' is a {type(obj).__name__}, not a callable that returns a Method; {fix}")
    try:
        made = obj()
    except Exception as e:
        said = str(e) if isinstance(e, TypeError) else ""
        former = [k for k in FORMER_FLAGS if f"unexpected keyword argument '{k}'" in said]
        hint = f"; {FORMER_FLAGS[former[0]]}" if former else ""
        raise PluginError(f"{where}: '{spec}()' raised {type(e).__name__}: {e}{hint}; {fix}") from None
    if not isinstance(made, Method):
        raise PluginError(
            f"{where}: '{spec}()' returned a {type(made).__name__}, not a halludetect.methods.spec.Method; {fix}"
        )
    if not (isinstance(made.params, type) and issubclass(made.params, Section)):
        raise PluginError(f"{where}: its Method's params is not a halludetect.core.sections.Section class; {fix}")
    if not isinstance(made.fit, Fit):
        raise PluginError(
            f"{where}: its Method's fit is {made.fit!r}, not a kind of fit: write fit=SGD (the shared loop), "
            "LOGISTIC_REGRESSION, SE_PROBE or UNSUPERVISED, from halludetect.methods.spec; " + fix
        )
    if not isinstance(made.reads, Reads):
        raise PluginError(f"{where}: its Method's reads is {made.reads!r}, not a halludetect.methods.spec.Reads; {fix}")
    if made.fit.loop and not {"lr", "weight_decay"} <= set(made.params.model_fields):
        raise PluginError(f"{where}: its params class needs lr and weight_decay (the training loop reads them); {fix}")
    return made


# Params keys DVC does not see: its run-cache hashes a stage's lock entry without any key named
# `size` or `nfiles` (file metadata elsewhere in the entry), at every depth, params included, so a
# stage whose only change is such a param is "cached" and gets its old outputs back
# (treeverse/dvc#10296, DVC 3.67.1 here). No built-in section has one (tests/methods/test_plugins.py).
DVC_BLIND_KEYS = ("size", "nfiles")


def dvc_blind_keys(kind, prefix: str = "", seen: frozenset = frozenset()) -> list[str]:
    """The dotted paths of the fields that DVC_BLIND_KEYS names, in a params section and in every
    section it holds: nested, optional (`Sub | None`), in a list or a dict's values."""
    found = []
    if isinstance(kind, type) and issubclass(kind, Section):
        if kind in seen:  # a section that holds itself
            return found
        seen = seen | {kind}
        for key, field in kind.model_fields.items():
            name = field.alias or key
            if name in DVC_BLIND_KEYS:
                found.append(f"{prefix}{name}")
            found += dvc_blind_keys(field.annotation, f"{prefix}{name}.", seen)
    for arg in typing.get_args(kind):  # Optional, Union, list[...], dict[..., ...], Annotated
        found += dvc_blind_keys(arg, prefix, seen)
    return found


def _register(name: str, made: Method, origin: Origin, where: str, fix: str) -> Method:
    if made.name != name:
        raise PluginError(f"{where}: the factory returned the method '{made.name}', registered as '{name}'; {fix}")
    if not NAME.fullmatch(name):
        raise PluginError(f"{where}: '{name}' is not a method name (lower case letters, digits, _); {fix}")
    if blind := dvc_blind_keys(made.params):
        keys = ", ".join(f"detectors.{name}.{k}" for k in blind)
        raise PluginError(
            f"{where}: its params section has {keys}: DVC's run-cache ignores a param named "
            f"{' or '.join(DVC_BLIND_KEYS)} (treeverse/dvc#10296), so changing it would give the stage's old "
            "outputs back instead of re-running it; rename the field in the plugin's params class"
        )
    existing = METHODS.get(name)
    if existing is not None:
        if existing.origin == origin:
            return existing  # the same factory again: nothing to do
        owner = "a built-in method" if existing.origin is None else existing.origin.describe()
        raise PluginError(f"{where}: '{name}' is already {owner}; give the plugin's method another name")
    if name in SCORES:
        raise PluginError(
            f"{where}: '{name}' is already a score with nothing to train (halludetect/methods/scores.py); "
            "give the plugin's method another name"
        )
    plugin = replace(made, family="yours", origin=origin)
    register(plugin)
    return plugin


def load_entry_points() -> None:
    """Register every installed `halludetect.detectors` entry point (once per process)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    for ep in sorted(installed(GROUP), key=lambda e: e.name):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "no distribution"
        where = f"entry point '{ep.name} = {ep.value}' (group {GROUP}, {dist})"
        fix = f"fix the package or uninstall it (pip uninstall {ep.dist.name if ep.dist else 'it'})"
        _register(ep.name, _factory(ep.value, where, fix), Origin(ep.value, "entry point", dist), where, fix)
    _entry_points_loaded = True


def load_factory(name: str, factory: str) -> Method:
    """Register `name` from a 'module:factory' spec (params key detectors.<name>.factory); the
    same spec twice is one registration."""
    where = f"detectors.{name}.factory"
    if not isinstance(factory, str):
        raise PluginError(f"{where}: expected 'module:factory' as a string, got {factory!r}")
    fix = "fix the module, or the params key"
    return _register(name, _factory(factory, where, fix), Origin(factory, "params"), where, fix)


def method(name: str) -> Method:
    """The method `name` (an installed plugin's too), or a did-you-mean error listing them all."""
    if name not in METHODS:
        load_entry_points()
    return registered(name)

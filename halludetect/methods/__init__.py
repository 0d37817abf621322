"""Detection methods, one file per family in this folder: the one place a method is declared.

Each file registers a `Method` (spec.py) per method it defines: its name (the key of `grid.detectors` and of
its params section `detectors.<name>`), the name the report prints, its params class, `build`,
which makes its network for states of width d, what it reads besides the bags (`Reads`: P_sem,
its question's other answers, the token positions) and its kind of fit (`Fit`: the shared SGD
loop, a closed-form logistic regression to the labels or to the semantic entropy, or none).
`config.py` derives the detectors params from this registry, the report its row names, and the
stages the trait lists below.

Adding a method is one file here (every module of this folder is imported, in name order), plus
its section in params.yaml, plus `make deps` (dvc.yaml's code deps are written from the imports).
A user's own package registers methods without editing this folder (plugins.py): an entry point
of the group `halludetect.detectors`, or a params key `detectors.<name>.factory`.

Why the network is passed to `build` rather than imported: every stage validates the whole
params file, so config.py, and with it this folder, is code of every stage. The files here import
no torch; the networks (detectors/networks.py) are code only of the stages that build detectors,
so an edit to a network re-trains detectors and never re-runs sampling or labelling.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Sequence

from halludetect.methods.plugins import GROUP, PluginError, load_entry_points, load_factory, method
from halludetect.methods.spec import (
    LOGISTIC_REGRESSION,
    METHODS,
    POSITIONS,
    SCORES,
    SE_PROBE,
    SGD,
    UNSUPERVISED,
    Fit,
    Method,
    Origin,
    Reads,
    Score,
    register,
    register_scores,
)

for _info in pkgutil.iter_modules(__path__):  # one module per family, in name order
    importlib.import_module(f"{__name__}.{_info.name}")


class _Trait(Sequence):
    """The names of the registered methods with a trait, in registration order: a live view, so
    that a plugin registered later (params.yaml's detectors.<name>.factory) is in it too."""

    def __init__(self, has: Callable[[Method], bool]):
        self._has = has

    def _names(self) -> list[str]:
        return [n for n, m in METHODS.items() if self._has(m)]

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        m = METHODS.get(name)
        return m is not None and self._has(m)

    def __repr__(self) -> str:
        return repr(tuple(self._names()))


# The trait lists the stages and the params checks use.
SP_METHODS = _Trait(lambda m: m.reads.p_sem)  # scale states by P_sem: bundles need each answer's P_sem
CLUSTER_METHODS = _Trait(lambda m: m.reads_clusters)  # read the clustering: P_sem or SE (routed to them: stage route)
ANALYZABLE = _Trait(lambda m: m.analysable)

__all__ = [
    "ANALYZABLE",
    "CLUSTER_METHODS",
    "GROUP",
    "LOGISTIC_REGRESSION",
    "METHODS",
    "POSITIONS",
    "SCORES",
    "SE_PROBE",
    "SGD",
    "SP_METHODS",
    "UNSUPERVISED",
    "Fit",
    "Method",
    "Origin",
    "Reads",
    "Score",
    "PluginError",
    "load_entry_points",
    "load_factory",
    "method",
    "register",
    "register_scores",
]


def trained(detectors: Sequence[str]) -> list[str]:
    """The detectors of a grid list that are trained on hidden states (not a score of methods/scores.py),
    in its order: those with weights, layers and token evidence, and those transfer applies."""
    return [name for name in detectors if name not in SCORES]

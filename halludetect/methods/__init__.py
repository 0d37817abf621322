"""Detection methods, one file per family in this folder: the one place a method is declared.

Each file registers a `Method` per method it defines: its name (the key of `grid.methods` and of
its params section `detectors.<name>`), the name the report prints, its params class, its traits,
and `build`, which makes its network for states of width d. `config.py` derives the detectors
params from this registry, the report its row names, and the stages the trait lists below.

Adding a method is one file here (every module of this folder is imported, in name order), plus
its section in params.yaml, plus `make deps` (dvc.yaml's code deps are written from the imports).

Why the network is passed to `build` rather than imported: every stage validates the whole
params file, so config.py, and with it this folder, is code of every stage. The files here import
no torch; the networks (detectors/networks.py) are code only of the stages that build detectors,
so an edit to a network re-trains detectors and never re-runs sampling or labelling.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from halludetect.core.lookup import lookup
from halludetect.core.sections import Section


@dataclass(frozen=True)
class Method:
    name: str
    display: str  # the report's row name
    params: type[Section]  # its section of params.yaml: detectors.<name>
    # (detectors.networks, d, this method's params) -> the network, an nn.Module mapping Bags to logits [B]
    build: Callable[[ModuleType, int, Any], Any]
    # Trains on token states scaled by P_sem (clusters.parquet), in train_sp@ stages of its own, so
    # that a clustering change never retrains the other methods.
    reads_p_sem: bool = False
    # A HaMI network (token MLP with batch norm, top-k mean): the sensitivity analysis applies.
    analysable: bool = False


METHODS: dict[str, Method] = {}


def register(*methods: Method) -> None:
    for m in methods:
        if m.name in METHODS:
            raise ValueError(f"detection method '{m.name}' is registered twice")
        METHODS[m.name] = m


def method(name: str) -> Method:
    """The registered method `name`, or a did-you-mean error listing every method."""
    return lookup("detector", name, METHODS)


for _info in pkgutil.iter_modules(__path__):  # one module per family, in name order
    importlib.import_module(f"{__name__}.{_info.name}")

# The trait lists the stages and the params checks use.
SP_METHODS = tuple(n for n, m in METHODS.items() if m.reads_p_sem)
ANALYZABLE = tuple(n for n, m in METHODS.items() if m.analysable)

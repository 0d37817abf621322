"""Detection methods, one file per family in this folder: the one place a method is declared.

Each file registers a `Method` (spec.py) per method it defines: its name (the key of `grid.methods` and of
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

from halludetect.methods.spec import METHODS, Method, method, register

for _info in pkgutil.iter_modules(__path__):  # one module per family, in name order
    importlib.import_module(f"{__name__}.{_info.name}")

# The trait lists the stages and the params checks use.
SP_METHODS = tuple(n for n, m in METHODS.items() if m.reads_p_sem)
ANALYZABLE = tuple(n for n, m in METHODS.items() if m.analysable)

__all__ = ["ANALYZABLE", "METHODS", "SP_METHODS", "Method", "method", "register"]

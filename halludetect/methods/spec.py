"""A detection method's declaration (`Method`) and the registry the files of methods/ add to."""

from __future__ import annotations

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

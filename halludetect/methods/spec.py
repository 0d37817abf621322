"""A detection method's declaration (`Method`) and the registry the files of methods/ add to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from halludetect.core.lookup import lookup
from halludetect.core.sections import Section

POSITIONS = ("predicting", "generated")  # dump.positions: which states a bag holds (docs/detectors.md)


@dataclass(frozen=True)
class Origin:
    """Where a method registered from outside halludetect comes from (methods/plugins.py)."""

    factory: str  # "module:factory", the callable that returned the Method
    via: str  # "entry point" (group halludetect.detectors) or "params" (key detectors.<name>.factory)
    distribution: str | None = None  # the installed distribution of an entry point, "name version"

    def describe(self) -> str:
        if self.via == "entry point":
            return f"the entry point '{self.factory}' (group halludetect.detectors, {self.distribution})"
        return f"the params key detectors.<name>.factory = '{self.factory}'"


@dataclass(frozen=True)
class Method:
    name: str
    display: str  # the report's row name
    params: type[Section]  # its section of params.yaml: detectors.<name>
    # (detectors.networks, d, this method's params) -> the network, an nn.Module mapping Bags to scores [B]
    build: Callable[[ModuleType, int, Any], Any]
    # Trains on token states scaled by P_sem (clusters.parquet, which the route stage hands to the
    # detectors that read it alone, so that a clustering change never retrains the other methods).
    reads_p_sem: bool = False
    # A HaMI network (token MLP with batch norm, top-k mean): the sensitivity analysis applies.
    analysable: bool = False
    # The report's block: the paper's methods, the field's baselines, or a user's own detector
    # (plugins are "yours" whatever they declare).
    family: Literal["paper", "field", "yours"] = "paper"
    # What it is trained to predict: the judge's label, or the binarised semantic entropy of the
    # response's question (semantic-entropy probes; read from clusters.parquet, routed to it like
    # P_sem).
    target: Literal["label", "semantic_entropy"] = "label"
    # How: "sgd" the shared loop (Adam, train.epochs, best epoch on validation; training.py),
    # "logistic_regression" a closed fit of the network's linear head (fitting.py), "none" an
    # unsupervised score with nothing to fit.
    fit: Literal["sgd", "logistic_regression", "none"] = "sgd"
    # Scores a question's answers together (EigenScore): every bag carries its question (Bags.groups),
    # and a question with fewer than two evaluated answers is left out, counted.
    per_question: bool = False
    # Whether its score is a logit (the margin mean(y z) is defined only then).
    logits: bool = True
    # The dump conventions it can read: a method that reads the state before the answer needs
    # `predicting` bags (the state at the last prompt position is not in a `generated` bag).
    positions: tuple[str, ...] = POSITIONS
    # Bags shorter than this are left out, counted (`too_short`): the token it reads does not exist.
    min_tokens: int = 1
    # Set for a method registered from outside (plugins.py): how to find its code again.
    origin: Origin | None = None

    @property
    def reads_clusters(self) -> bool:
        """Reads the clustering (clusters.parquet, routed to it by the route stage): P_sem or semantic entropy."""
        return self.reads_p_sem or self.target == "semantic_entropy"

    @property
    def needs(self) -> tuple[str, ...]:
        """What one more response costs it beyond the answer, for the report's marks."""
        out = []
        if self.fit != "none":
            out.append("labels" if self.target == "label" else "SE labels (sampling + NLI) to train")
        if self.reads_p_sem:
            out.append("sampling + NLI")
        elif self.per_question:
            out.append("sampling")
        out.append("hidden states")
        return tuple(out)


METHODS: dict[str, Method] = {}


def register(*methods: Method) -> None:
    for m in methods:
        if m.name in METHODS:
            raise ValueError(f"detection method '{m.name}' is registered twice")
        if m.min_tokens < 1 or not set(m.positions) <= set(POSITIONS) or not m.positions:
            raise ValueError(f"detection method '{m.name}': min_tokens >= 1 and positions among {POSITIONS}")
        METHODS[m.name] = m


def registered(name: str) -> Method:
    """The registered method `name`, or a did-you-mean error listing every method (plugins.method
    looks among the installed plugins first)."""
    return lookup("detector", name, METHODS)

"""The declarations of detectors: a method on hidden states (`Method`) and a score with nothing to
train (`Score`), and the registries the files of methods/ add to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from halludetect.core.lookup import lookup
from halludetect.core.sections import Section

POSITIONS = ("predicting", "generated")  # dump.positions: which states a bag holds (docs/detectors.md)
# What one more response costs a detector beyond its answer, in the words of the report's marks
# (each row's [...]) and of the costs the stages charge (evaluation/costs.py): one vocabulary for
# the methods (Method.needs derives theirs) and the scores (each declares its own).
NEEDS = (
    "labels",
    "SE labels (sampling + NLI) to train",
    "sampling + NLI",
    "sampling",
    "token log-probs",
    "a forward pass",
    "hidden states",
)


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


def _is_target(value) -> bool:
    """A "module:object" string (core/registry.py resolves it when it is needed)."""
    module, sep, attr = value.partition(":") if isinstance(value, str) else ("", "", "")
    return bool(sep and module.strip() and attr.strip())


@dataclass(frozen=True)
class Reads:
    """What a detector reads besides a response's bag of hidden states: a declaration the pipeline
    answers (the route stage hands it the clustering, detectors/data.py builds its bags, the scorer
    asks a user's rows for it), never code the method runs."""

    # Each response's P_sem, by which its token states are scaled at train and test time (HaMI (SP)):
    # the clustering, so K sampled answers and NLI per question.
    p_sem: bool = False
    # The other answers to its question, scored together (EigenScore): every bag carries its
    # question (Bags.groups), and a question with fewer than two evaluated answers is left out, counted.
    question: bool = False
    # The dump conventions it can read: a method that reads the state before the answer needs
    # `predicting` bags (the state at the last prompt position is not in a `generated` bag).
    positions: tuple[str, ...] = POSITIONS
    # Bags shorter than this are left out, counted (`too_short`): the token it reads does not exist.
    min_tokens: int = 1


@dataclass(frozen=True)
class Fit:
    """How a detector is fitted: one of the kinds below (SGD, LOGISTIC_REGRESSION, SE_PROBE,
    UNSUPERVISED). The code that trains asks the kind, never the method's name: the shared loop
    runs the kinds without a `fitter` (detectors/loop.py); the others are fitted in one step by
    their `fitter` (detectors/fitting.py), deterministic, so every seed gives the same detector."""

    name: Literal["sgd", "logistic_regression", "none"]  # what the docs and the errors call it
    # What it is fitted to predict: the judge's label, the binarised semantic entropy of the
    # response's question (semantic-entropy probes: read from the clustering, routed to it like
    # P_sem), or nothing (an unsupervised score, which never scores the train split either).
    target: Literal["label", "semantic_entropy"] | None = "label"
    # "module:function" (model, method, params, train split) -> what the fit did, resolved when a
    # detector is fitted: the fits import torch and scikit-learn, which this file must not.
    fitter: str | None = None

    def __post_init__(self):
        problems = []
        if self.name not in ("sgd", "logistic_regression", "none"):
            problems.append(f"name {self.name!r} is none of sgd, logistic_regression, none")
        if (self.fitter is None) != (self.name == "sgd"):
            problems.append("the shared loop (sgd) has no fitter, every other kind one")
        if (self.target is None) != (self.name == "none"):
            problems.append("an unsupervised kind (none) has no target, every other kind one")
        if self.target not in ("label", "semantic_entropy", None):
            problems.append(f"target {self.target!r} is neither label nor semantic_entropy")
        if self.fitter is not None and not _is_target(self.fitter):
            problems.append(f"fitter {self.fitter!r} is not a 'module:function' string")
        if problems:
            raise ValueError(f"Fit{(self.name, self.target, self.fitter)!r}: " + "; ".join(problems))

    @property
    def loop(self) -> bool:
        """Trained by the shared loop (Adam, train.epochs, best epoch on validation; training.py)."""
        return self.fitter is None

    def fit(self, model, method: str, params, train) -> dict:
        from halludetect.core.registry import load_target

        return load_target(self.fitter, f"the fit of {method}")(model, method, params, train)


SGD = Fit("sgd")  # the shared loop
LOGISTIC_REGRESSION = Fit("logistic_regression", fitter="halludetect.detectors.fitting:fit_logistic")
SE_PROBE = Fit("logistic_regression", "semantic_entropy", "halludetect.detectors.fitting:fit_logistic")
UNSUPERVISED = Fit("none", None, "halludetect.detectors.fitting:fit_nothing")


@dataclass(frozen=True)
class Method:
    """A detection method: what it is called, its params, its network (`build`), what it reads
    (`reads`), how it is fitted (`fit`) and what its score is (`logits`)."""

    name: str
    display: str  # the report's row name
    params: type[Section]  # its section of params.yaml: detectors.<name>
    # (detectors.networks, d, this method's params) -> the network, an nn.Module mapping Bags to scores [B]
    build: Callable[[ModuleType, int, Any], Any]
    reads: Reads = Reads()
    fit: Fit = SGD
    # Whether its score is a logit (the margin mean(y z) is defined only then).
    logits: bool = True
    # A HaMI network (token MLP with batch norm, top-k mean): the sensitivity analysis applies.
    analysable: bool = False
    # The report's block: the paper's methods, the field's baselines, or a user's own detector
    # (plugins are "yours" whatever they declare).
    family: Literal["paper", "field", "yours"] = "paper"
    # Set for a method registered from outside (plugins.py): how to find its code again.
    origin: Origin | None = None

    @property
    def reads_clusters(self) -> bool:
        """Reads the clustering (clusters.parquet, routed to it by the route stage): P_sem or semantic entropy."""
        return self.reads.p_sem or self.fit.target == "semantic_entropy"

    @property
    def needs(self) -> tuple[str, ...]:
        """What one more response costs it beyond the answer, for the report's marks."""
        out = []
        if self.fit.target is not None:
            out.append("labels" if self.fit.target == "label" else "SE labels (sampling + NLI) to train")
        if self.reads.p_sem:
            out.append("sampling + NLI")
        elif self.reads.question:
            out.append("sampling")
        out.append("hidden states")
        return tuple(out)


@dataclass(frozen=True)
class Score:
    """A detector with nothing to train and no hidden states (methods/scores.py): one number per
    response, higher = more likely hallucinated, its sign fixed by definition."""

    name: str  # its name in grid.detectors, and its params section detectors.<name>
    display: str  # the report's row name
    needs: tuple[str, ...]  # what one more response costs beyond the answer (the report's marks)
    # "module:function" computing it, resolved by stages/train_score.py: from the sampled answers and
    # their clustering ((generations, clusters, its params) -> columns rid, score:
    # evaluation/baselines.py), or from the model asked again (evaluation/p_true.py). The code stage
    # follows this module into the score's digest, so an edit to it re-runs that score alone.
    compute: str
    params: type[Section]  # its section of params.yaml: detectors.<name>
    # What it is computed from: the sampled answers, or one more forward pass of the model per
    # answer (the route stage hands the model preset to those alone).
    source: Literal["answers", "model"] = "answers"
    family: Literal["paper", "field"] = "field"  # the report's block (P_sem is the paper's quantity)

    @property
    def reads_clusters(self) -> bool:
        return "sampling + NLI" in self.needs  # P_sem, the entropy or the sets of its clustering

    def __post_init__(self):
        if self.source not in ("answers", "model") or self.family not in ("paper", "field"):
            raise ValueError(f"score '{self.name}': source is answers or model, family paper or field")
        if not set(self.needs) <= set(NEEDS):
            raise ValueError(f"score '{self.name}': needs {self.needs!r}: each one of {NEEDS}")
        if not _is_target(self.compute):
            raise ValueError(f"score '{self.name}': compute {self.compute!r} is not a 'module:function' string")
        if not (isinstance(self.params, type) and issubclass(self.params, Section)):
            raise ValueError(f"score '{self.name}': params is its section class (a core.sections.Section)")


METHODS: dict[str, Method] = {}
SCORES: dict[str, Score] = {}


def register_scores(*scores: Score) -> None:
    for s in scores:
        if s.name in SCORES:
            raise ValueError(f"score '{s.name}' is registered twice")
        if s.name in METHODS:
            raise ValueError(f"score '{s.name}': already the name of a detection method")
        SCORES[s.name] = s


def register(*methods: Method) -> None:
    for m in methods:
        if m.name in METHODS:
            raise ValueError(f"detection method '{m.name}' is registered twice")
        if m.name in SCORES:
            raise ValueError(f"detection method '{m.name}': already the name of a score (methods/scores.py)")
        if not isinstance(m.reads, Reads) or not isinstance(m.fit, Fit):
            raise ValueError(
                f"detection method '{m.name}': reads is a spec.Reads and fit one of spec's Fit kinds "
                f"(got reads={m.reads!r}, fit={m.fit!r})"
            )
        r = m.reads
        if r.min_tokens < 1 or not set(r.positions) <= set(POSITIONS) or not r.positions:
            raise ValueError(f"method '{m.name}': reads.min_tokens >= 1 and reads.positions among {POSITIONS}")
        METHODS[m.name] = m


def registered(name: str) -> Method:
    """The registered method `name`, or a did-you-mean error listing every method (plugins.method
    looks among the installed plugins first)."""
    return lookup("detector", name, METHODS)

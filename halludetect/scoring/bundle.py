"""A trained detector as one self-contained file: everything `halludetect score` needs to
rebuild the detector's input and read its output.

One safetensors file:

    tensors   every seed's detector weights, named `seed_<S>.<parameter>`
    metadata  one sorted JSON entry, "bundle" (one entry, as in detector files: safetensors
              writes several in no fixed order, and the same bundle must give the same bytes):
      format, format_version       "halludetect-bundle", 3
      digest                       sha256 of every tensor (its dtype, shape and bytes) and of
                                   the rest of the metadata: a flipped byte is named on load
      method, params, d            the detector, rebuilt from the registry (no pickles)
      layer, n_layers              the hidden state it reads (0 = embeddings; n_layers = the
                                   top, which carries the final norm)
      base_model                   preset name, path (hub id or local directory), revision,
                                   and what pins it: the hub commit it resolved to, or the
                                   sha256 of every file of a local model (its manifest),
                                   hidden_size, num_hidden_layers, the full preset
      inputs                       positions convention, prompt template text and hash,
                                   chat_template flag, the dtype the states were stored in;
                                   for a method that reads P_sem (hami_sp), `p_sem`: the
                                   variant, lam, K answers per question and the clustering
                                   (equivalence rule, NLI backend) its P_sem came from
      seeds, combine               "mean_logit": the score is the mean of the seeds' logits
      thresholds, default_threshold  chosen on validation: at target false-positive rates
                                   (`fpr_0.05`: the lowest logit whose validation FPR is at most
                                   5%) and at the best F1 (`best_f1`), each with the FPR and TPR
                                   it reaches on validation and, for the reader, on test; the
                                   default is export.threshold's (fpr_0.05 unless set)
      calibration                  Platt scaling p = sigmoid(a z + b), fitted on validation
      evaluation                   the DAG's test AUROC at that layer (per seed), the
                                   ensemble's validation and test AUROC, each split's answers
                                   and hallucinated answers
      answer_range                 (optional) the range of the token log-probs of the answers
                                   the detector was fit on, and the bounds past which `score`
                                   marks a row out of distribution (scoring/answer_range.py);
                                   without it, `score` leaves in_distribution null

Why an ensemble of the seeds rather than the best one: picking the best seed on test would
select on test; on validation, seeds differ by less than validation's own noise (a few
hundred responses), so "best" mostly picks noise. The mean of the logits of independently
trained detectors has less variance than any one of them, uses every seed the DAG reported,
and costs S detector passes, nothing next to the transformer blocks that produce its input.
Its own test AUROC is measured at export and stored beside the per-seed ones.

Loading checks what it reads before anything scores with it, each failure a `BundleError`
naming the bundle and the key or tensor: the metadata's types and shapes (`BundleMeta`) and
how its entries fit together (layer within the model, width, default threshold, prompt hash),
the digest of every tensor and of the metadata, and that every weight is finite. Older bundles
are still read, each with a warning (`Bundle.warnings`) on every load: format 1 (written before
the digest) with every check but the digest's, since damage to its bytes cannot be detected;
format 2 (written before the thresholds' test rates and the splits' hallucinated counts) with
every check, saying what `show` cannot print and, when its default is the best F1 (the default
then), what share of correct validation answers that flags. `dvc repro export` writes them again
in format 3.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import polars as pl
import torch
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, NonNegativeInt, PositiveInt, ValidationError
from torch import nn

from halludetect.activations.bags import Bags
from halludetect.config import ExportParams, threshold_name
from halludetect.core.atomic_io import atomic_path, file_sha256
from halludetect.core.errors import DataError
from halludetect.core.lookup import UnknownName
from halludetect.detectors.build import (
    build_detector,
    check_known,
    check_scores,
    load_detector,
    origin_meta,
    params_for,
)
from halludetect.detectors.evidence import Evidence, NoEvidence, describe, ensemble_evidence
from halludetect.methods import SP_METHODS, PluginError
from halludetect.methods import method as lookup_method
from halludetect.metrics import auroc
from halludetect.prompts import template_hash
from halludetect.scoring.answer_range import answer_range

FORMAT = "halludetect-bundle"
# 3: each threshold's validation and test rates, each split's hallucinated count (read with a
#    warning without them: format 2); 2: the digest of the tensors and the metadata (read with a
#    warning without it: format 1)
FORMAT_VERSION = 3
READS = (1, 2, 3)
COMBINE = "mean_logit"
META_KEY = "bundle"


class BundleError(DataError):
    """A bundle file that cannot be used: not a bundle, damaged, or for another model or input."""


# ------------------------------------------------------------------ the metadata's shape
class _Meta(BaseModel):
    # strict: a number written as a string, or a flag as 0/1, is damage, not something to convert
    model_config = ConfigDict(strict=True, extra="allow")


Rate = Annotated[float, Field(ge=0, le=1)]


class ThresholdMeta(_Meta):
    threshold: FiniteFloat
    target_fpr: Annotated[float, Field(gt=0, lt=1)] | None = None  # fpr_<target> thresholds
    val_fpr: Rate | None = None  # format 3 requires the rates (check_meta); older bundles may lack them
    val_tpr: Rate | None = None
    test_fpr: Rate | None = None
    test_tpr: Rate | None = None


class EvaluationMeta(_Meta):
    n_val: PositiveInt | None = None
    n_test: PositiveInt | None = None
    n_val_hallucinated: NonNegativeInt | None = None  # format 3
    n_test_hallucinated: NonNegativeInt | None = None


class CalibrationMeta(_Meta):
    method: Literal["platt"]
    a: FiniteFloat
    b: FiniteFloat
    converged: bool | None = None  # false: validation separated the classes (fit_platt); absent before it was kept


class BaseModelMeta(_Meta):
    path: str
    revision: str | None
    resolved_revision: str | None
    files: dict[str, str] | None
    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    preset: dict[str, Any]


class InputsMeta(_Meta):
    positions: Literal["predicting", "generated"]
    prompt_template: str
    prompt_hash: str
    chat_template: bool
    states_dtype: Literal["float16", "float32", "bfloat16"]


class DigestMeta(_Meta):
    algorithm: Literal["sha256"]
    tensors: dict[str, str]
    metadata: str


class BoundMeta(_Meta):
    low: FiniteFloat | None
    high: FiniteFloat | None


class StatMeta(_Meta):
    min: FiniteFloat
    max: FiniteFloat


class AnswerRangeMeta(_Meta):
    """scoring/answer_range.py's record: what `score` compares each row with."""

    fit_splits: list[str] = Field(min_length=1)
    n: PositiveInt
    rule: str
    stats: dict[Literal["mean_logprob", "min_logprob", "n_tokens"], StatMeta]
    bounds: dict[Literal["mean_logprob", "min_logprob", "n_tokens"], BoundMeta]


class BundleMeta(_Meta):
    """What `load_bundle` requires of the metadata, type by type (relations: `check_meta`)."""

    format: Literal["halludetect-bundle"]
    format_version: Literal[1, 2, 3]
    method: str
    params: dict[str, Any]
    d: PositiveInt
    layer: NonNegativeInt
    n_layers: PositiveInt
    base_model: BaseModelMeta
    inputs: InputsMeta
    seeds: list[int] = Field(min_length=1)
    combine: Literal["mean_logit"]
    thresholds: dict[str, ThresholdMeta] = Field(min_length=1)
    default_threshold: str
    calibration: CalibrationMeta
    evaluation: EvaluationMeta
    digest: DigestMeta | None = None
    answer_range: AnswerRangeMeta | None = None


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (any dtype: bfloat16 has no numpy view)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{list(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def metadata_digest(meta: dict) -> str:
    """sha256 of the metadata without its digest entry, as JSON with sorted keys."""
    rest = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, allow_nan=False).encode()).hexdigest()


# ------------------------------------------------------------------ thresholds and calibration
def _labelled(y, z) -> tuple[np.ndarray, np.ndarray]:
    """(y as bool [n], z as float64 [n]), checked: same length, finite scores, both classes."""
    y, z = np.asarray(y).astype(bool), np.asarray(z, dtype=np.float64)
    if y.shape != z.shape or y.ndim != 1:
        raise ValueError(f"labels {y.shape} and scores {z.shape} must be two vectors of one length")
    if not np.isfinite(z).all():
        raise ValueError(f"{int((~np.isfinite(z)).sum())} score(s) are not finite")
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        raise ValueError(
            f"{pos} hallucinated and {neg} correct answer(s): a false- and a true-positive rate need both classes"
        )
    return y, z


def rates_at_threshold(y, z, threshold: float) -> dict:
    """What flagging `z >= threshold` does to labelled scores (y = 1: hallucinated): its false- and
    true-positive rates, precision and F1, and the counts they come from. A transfer check calls it
    with one dataset's threshold on another's scores."""
    y, z = _labelled(y, z)
    flag = z >= threshold
    tp, fp = int((flag & y).sum()), int((flag & ~y).sum())
    pos, neg = int(y.sum()), int((~y).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    return {
        "threshold": float(threshold),
        "fpr": fp / neg,
        "tpr": tp / pos,
        "precision": precision,
        "f1": 2 * tp / (tp + fp + pos),  # = 2 P R / (P + R), and 0 when nothing is flagged
        "flagged": tp + fp,
        "positives": pos,
        "negatives": neg,
    }


def _distinct(y: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every distinct score, highest first, and the true and false positives of flagging z >= it:
    tied scores are flagged together, so a threshold never splits them."""
    order = np.argsort(-z, kind="mergesort")
    zs, ys = z[order], y[order]
    ends = np.r_[np.flatnonzero(np.diff(zs)), len(zs) - 1]  # the last index of each distinct score
    return zs[ends], np.cumsum(ys)[ends], np.cumsum(~ys)[ends]


def threshold_at_fpr(y, z, target_fpr: float) -> dict:
    """The lowest threshold whose false-positive rate on (y, z) is at most `target_fpr` (flag =
    z >= threshold), with `rates_at_threshold`'s figures and `target_fpr`: the most hallucinations
    caught at that rate. Tied scores are flagged together, so the rate reached may be below the
    target. When even the highest score is a correct answer's and flagging it alone exceeds the
    target, the threshold sits just above the highest score and flags nothing (`flagged` 0)."""
    if not 0.0 < target_fpr < 1.0:
        raise ValueError(f"target false-positive rate {target_fpr!r} is not strictly between 0 and 1")
    y, z = _labelled(y, z)
    scores, _, fp = _distinct(y, z)
    within = np.flatnonzero(fp / (~y).sum() <= target_fpr)  # a prefix: fp never decreases
    t = float(scores[within[-1]]) if within.size else float(np.nextafter(scores[0], math.inf))
    return {"target_fpr": target_fpr, **rates_at_threshold(y, z, t)}


def threshold_best_f1(y, z) -> dict:
    """The threshold of the highest F1 on (y, z) (the lowest such threshold on ties), with
    `rates_at_threshold`'s figures."""
    y, z = _labelled(y, z)
    scores, tp, fp = _distinct(y, z)
    f1 = 2 * tp / (tp + fp + y.sum())
    best = np.flatnonzero(f1 == f1.max())[-1]
    return rates_at_threshold(y, z, float(scores[best]))


def threshold_entry(rule: dict, test: tuple[np.ndarray, np.ndarray]) -> dict:
    """A bundle's record of a threshold chosen on validation (`rule`: `threshold_at_fpr`'s or
    `threshold_best_f1`'s figures): what it does on validation, and on test, measured for the
    reader only (test never chooses)."""
    on_test = rates_at_threshold(*test, rule["threshold"])
    return {
        **({"target_fpr": rule["target_fpr"]} if "target_fpr" in rule else {}),
        "threshold": rule["threshold"],
        "val_fpr": rule["fpr"],
        "val_tpr": rule["tpr"],
        "val_precision": rule["precision"],
        "val_f1": rule["f1"],
        "test_fpr": on_test["fpr"],
        "test_tpr": on_test["tpr"],
    }


def choose_thresholds(
    y: np.ndarray, z: np.ndarray, fpr_targets: list[float], test: tuple[np.ndarray, np.ndarray]
) -> dict[str, dict]:
    """A bundle's thresholds on validation logits (y, z): at each target false-positive rate
    (`fpr_<target>`) and at the best F1 (`best_f1`), each with its validation and test figures."""
    out = {threshold_name(t): threshold_entry(threshold_at_fpr(y, z, t), test) for t in fpr_targets}
    out["best_f1"] = threshold_entry(threshold_best_f1(y, z), test)
    return out


PLATT_MAX_STEPS = 100


def fit_platt(y: np.ndarray, z: np.ndarray) -> dict:
    """Platt scaling p = sigmoid(a z + b): the unregularised logistic regression of the labels on the
    logits, fitted by Newton's method with a backtracking line search (Platt's own fit; Lin, Lin and
    Weng 2007 for the safeguards). Two parameters need no optimiser library: this is the exact
    maximum-likelihood fit (to the last digits, where lbfgs stops at its tolerance), and it spares
    every evaluate and transfer stage the 1.2 s import of scikit-learn. On validation logits that
    separate the classes perfectly the likelihood has no maximum (a grows without bound): the fit
    stops after PLATT_MAX_STEPS steps and says `converged: false`."""
    y, z = np.asarray(y, dtype=np.float64), np.asarray(z, dtype=np.float64)
    x = np.stack([z, np.ones_like(z)], axis=1)  # [n, 2]

    def nll(w: np.ndarray) -> float:
        s = x @ w  # [n] a z + b
        return float(np.sum(np.logaddexp(0.0, s) - y * s))  # -sum(y log p + (1 - y) log(1 - p))

    rate = np.clip(y.mean(), 1e-12, 1 - 1e-12)
    w = np.array([0.0, math.log(rate / (1 - rate))])  # a = 0: every answer at the base rate
    loss, converged = nll(w), False
    for _ in range(PLATT_MAX_STEPS):
        p = 1 / (1 + np.exp(-(x @ w)))
        grad = x.T @ (p - y)  # [2]
        hess = (x * (p * (1 - p))[:, None]).T @ x  # [2, 2]
        try:
            step = np.linalg.solve(hess + 1e-12 * np.eye(2), grad)
        except np.linalg.LinAlgError:  # every p at 0 or 1: nothing more to gain
            break
        t = 1.0
        while t > 1e-10 and (new := nll(w - t * step)) > loss + 1e-4 * t * float(grad @ -step):
            t /= 2  # Armijo: halve until the loss falls by a share of what the step promised
        if t <= 1e-10:
            converged = bool(np.max(np.abs(grad)) <= 1e-8 * len(y))
            break
        w, loss = w - t * step, new
        if np.max(np.abs(t * step)) <= 1e-12 * (1 + np.max(np.abs(w))):
            converged = True
            break
    a, b = float(w[0]), float(w[1])
    p = 1 / (1 + np.exp(-(a * z + b)))
    return {
        "method": "platt",
        "a": a,
        "b": b,
        "fitted_on": "val",
        "n": int(len(y)),
        "converged": converged,
        "val_log_loss": loss / len(y),
        "val_brier": float(np.mean((p - y) ** 2)),
    }


# ---------------------------------------------------------------------------- the bundle
@dataclass
class Bundle:
    """A loaded bundle: its metadata and one detector per seed (in eval mode). `warnings`: what
    loading could not check (a format 1 bundle has no digest), for the caller to show."""

    meta: dict
    detectors: dict[int, nn.Module]
    path: Path | None = None
    sha256: str | None = None
    warnings: list[str] = field(default_factory=list)
    _device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def method(self) -> str:
        return self.meta["method"]

    @property
    def layer(self) -> int:
        return int(self.meta["layer"])

    @property
    def n_layers(self) -> int:
        return int(self.meta["n_layers"])

    @property
    def positions(self) -> str:
        return self.meta["inputs"]["positions"]

    @property
    def seeds(self) -> list[int]:
        return list(self.meta["seeds"])

    @property
    def per_question(self) -> bool:
        """EigenScore: a question's answers are scored together, never one answer alone."""
        return lookup_method(self.method).per_question

    @property
    def reads_p_sem(self) -> bool:
        """hami_sp scales the states by each answer's semantic probability: inputs must carry it."""
        return self.method in SP_METHODS

    def to(self, device) -> Bundle:
        self._device = torch.device(device)
        for det in self.detectors.values():
            det.to(self._device)
        return self

    @torch.no_grad()
    def seed_logits(self, bags: Bags) -> torch.Tensor:
        """[S, B] each seed's bag logits, in the order of `seeds`. A plugin's network that returns
        anything but one score per bag stops here naming it (a non-finite score: the scorer names
        the row)."""
        out = []
        for s in self.seeds:
            z = self.detectors[s](bags)  # [B]
            check_scores(self.method, z, len(bags), "a batch of answers", finite=False)
            out.append(z)
        return torch.stack(out)

    def evidence(self, bags: Bags) -> Evidence:
        """The token evidence of the seeds' mean logit (detectors/evidence.py): score = bias + sum_t c_t."""
        return ensemble_evidence([self.detectors[s] for s in self.seeds], bags)

    def evidence_rule(self) -> str:
        """How this bundle's score splits over tokens (one line); a BundleError saying what its
        method reports instead when it has no token evidence."""
        try:
            return describe(self.detectors[self.seeds[0]])
        except NoEvidence as e:
            raise BundleError(
                f"{self.path or 'the bundle'} ('{self.method}'): {e}; score it without --explain"
            ) from None

    def probability(self, z: np.ndarray) -> np.ndarray:
        c = self.meta["calibration"]
        x = c["a"] * np.asarray(z, dtype=np.float64) + c["b"]
        return np.exp(-np.logaddexp(0.0, -x))  # sigmoid(x), without overflow for |x| > 709

    def threshold(self, choice: str | float | None = None) -> tuple[str, float]:
        """(name, value) of a stored threshold (`best_f1`, `fpr_0.05`, ...), the default one for
        None, or a number given as is."""
        stored = self.meta["thresholds"]
        if choice is None:
            choice = self.meta["default_threshold"]
        if isinstance(choice, int | float) and not isinstance(choice, bool):
            name, value = f"{float(choice):g}", float(choice)
        else:
            name, value = str(choice), _number(choice)
        if value is not None:
            if not math.isfinite(value):
                raise BundleError(
                    f"threshold {choice!r} is not a finite logit: give one this bundle stores "
                    f"({', '.join(sorted(stored))}) or a finite number"
                )
            return name, value
        if choice not in stored:
            raise BundleError(
                f"unknown threshold '{choice}': this bundle has {', '.join(sorted(stored))}, or give a logit value"
            )
        return str(choice), float(stored[choice]["threshold"])


def _number(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def save_bundle(path: str | Path, detectors: dict[int, dict[str, torch.Tensor]], meta: dict) -> None:
    """Write a bundle atomically: each seed's state dict under `seed_<S>.`, `meta` as one JSON entry,
    in the current format, with the digest of what is written (any digest in `meta` is replaced)."""
    from safetensors.torch import save_file

    tensors = {
        f"seed_{seed}.{k}": v.detach().cpu().contiguous() for seed, sd in detectors.items() for k, v in sd.items()
    }
    meta = {k: v for k, v in meta.items() if k != "digest"} | {"format": FORMAT, "format_version": FORMAT_VERSION}
    meta["digest"] = {
        "algorithm": "sha256",
        "tensors": {name: tensor_digest(t) for name, t in sorted(tensors.items())},
        "metadata": metadata_digest(meta),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta, sort_keys=True, allow_nan=False)})


RE_EXPORT = "re-export it (dvc repro evaluate@<model>-<dataset>-<method>) or copy it again"


def _key(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(the metadata)"


def check_meta(path: Path, meta: object) -> dict:
    """The metadata's types and shapes, and how its entries fit together; a `BundleError` naming
    the bundle and every key that is wrong."""
    if not isinstance(meta, dict):
        raise BundleError(f"{path}: the bundle metadata is {type(meta).__name__}, not an object: {RE_EXPORT}")
    if meta.get("format") != FORMAT or meta.get("format_version") not in READS:
        raise BundleError(
            f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; this "
            f"halludetect reads {FORMAT!r} versions {', '.join(map(str, READS[:-1]))} and {READS[-1]}"
        )
    try:
        BundleMeta.model_validate(meta)
    except ValidationError as e:
        problems = [
            f"'{_key(err['loc'])}': {err['msg'].lower()}"
            + ("" if err["type"] == "missing" else f" (got {json.dumps(err['input'])[:60]})")
            for err in e.errors()
        ]
        raise BundleError(f"{path}: bundle metadata {'; '.join(problems)}: {RE_EXPORT}") from None
    problems = []
    base, inputs = meta["base_model"], meta["inputs"]
    if meta["layer"] > meta["n_layers"]:
        problems.append(f"'layer' {meta['layer']} is above 'n_layers' {meta['n_layers']}")
    if meta["n_layers"] != base["num_hidden_layers"]:
        problems.append(f"'n_layers' {meta['n_layers']} but 'base_model.num_hidden_layers' {base['num_hidden_layers']}")
    if meta["d"] != base["hidden_size"]:
        problems.append(f"'d' {meta['d']} but 'base_model.hidden_size' {base['hidden_size']}")
    if len(set(meta["seeds"])) != len(meta["seeds"]):
        problems.append(f"'seeds' {meta['seeds']} repeats a seed")
    if meta["default_threshold"] not in meta["thresholds"]:
        problems.append(f"'default_threshold' {meta['default_threshold']!r} is none of 'thresholds'")
    if template_hash(inputs["prompt_template"]) != inputs["prompt_hash"]:
        problems.append("'inputs.prompt_template' does not match 'inputs.prompt_hash'")
    if meta["format_version"] >= 2 and meta.get("digest") is None:
        problems.append(f"'digest' is missing (format version {meta['format_version']} records it)")
    problems += _threshold_problems(meta)
    if problems:
        raise BundleError(f"{path}: bundle metadata {'; '.join(problems)}: {RE_EXPORT}")
    return meta


# What format 3 added: each threshold's rates on validation and test, each split's hallucinated count.
V3_THRESHOLD_KEYS = ("val_fpr", "val_tpr", "test_fpr", "test_tpr")
V3_EVALUATION_KEYS = ("n_val", "n_test", "n_val_hallucinated", "n_test_hallucinated")


def _threshold_problems(meta: dict) -> list[str]:
    """How the thresholds fit their names and rates; in format 3, the keys it records."""
    problems = []
    v3 = meta["format_version"] >= 3
    for name, entry in sorted(meta["thresholds"].items()):
        if v3:
            missing = [k for k in V3_THRESHOLD_KEYS if entry.get(k) is None]
            problems += [f"'thresholds.{name}.{k}' is missing (format 3 records it)" for k in missing]
        target = entry.get("target_fpr")
        if name.startswith("fpr_") and (target is None or threshold_name(target) != name):
            problems.append(f"'thresholds.{name}.target_fpr' is {target!r}, not the rate its name says")
        elif target is not None and entry.get("val_fpr") is not None and entry["val_fpr"] > target:
            problems.append(f"'thresholds.{name}.val_fpr' {entry['val_fpr']:g} is above its 'target_fpr' {target:g}")
    if v3:
        missing = [k for k in V3_EVALUATION_KEYS if meta["evaluation"].get(k) is None]
        problems += [f"'evaluation.{k}' is missing (format 3 records it)" for k in missing]
    return problems


def _some(names: list[str]) -> str:
    return f"{len(names)} tensor(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def format_warnings(path: Path, meta: dict) -> list[str]:
    """What a bundle older than format 3 lacks, and what its default threshold does on validation
    when it is the best F1 (the default before format 3; it flags many correct answers)."""
    lacks = any(e.get("test_fpr") is None for e in meta["thresholds"].values())
    if meta["format_version"] >= 3 or not lacks:
        return []
    out = (
        f"{path} is a format {meta['format_version']} bundle, written before bundles recorded how each "
        "threshold does on test: `halludetect show` prints validation figures only; "
        f"{RE_EXPORT.replace('or copy it again', 'to add them')}"
    )
    default = meta["thresholds"][meta["default_threshold"]]
    if meta["default_threshold"] == "best_f1" and default.get("val_fpr") is not None:
        today = ExportParams().threshold  # the export's default now
        instead = f"pass --threshold {today} or re-export it" if today in meta["thresholds"] else "re-export it"
        out += (
            f"; its default threshold, best_f1, flags {default['val_fpr']:.0%} of validation's correct "
            f"answers ({instead} for a default chosen at a false-positive rate)"
        )
    return [out]


def check_tensors(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The digest of every tensor and of the metadata, and finite weights; returns warnings
    (a format 1 bundle's, which has no digest)."""
    warnings = []
    digest = meta.get("digest")
    if digest is None:
        warnings.append(
            f"{path} is a format {meta['format_version']} bundle, written before bundles recorded a digest: "
            f"damage to its bytes cannot be detected; {RE_EXPORT.replace('or copy it again', 'to add one')}"
        )
    else:
        if metadata_digest(meta) != digest["metadata"]:
            raise BundleError(f"{path}: its metadata does not match the digest recorded with it: damaged; {RE_EXPORT}")
        missing, extra = sorted(set(digest["tensors"]) - set(tensors)), sorted(set(tensors) - set(digest["tensors"]))
        if missing or extra:
            what = [f"lacks {_some(missing)} that its digest lists"] if missing else []
            what += [f"holds {_some(extra)} that its digest does not list"] if extra else []
            raise BundleError(f"{path}: {' and '.join(what)}: damaged; {RE_EXPORT}")
        for name in sorted(tensors):
            if tensor_digest(tensors[name]) != digest["tensors"][name]:
                raise BundleError(
                    f"{path}: tensor '{name}' does not match the digest recorded with it: damaged; {RE_EXPORT}"
                )
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        # numpy: torch's elementwise kernels wait on their thread pool, slow on a busy machine
        a = t.detach().cpu().numpy() if t.dtype in (torch.float16, torch.float32, torch.float64) else t.float().numpy()
        if not (finite := np.isfinite(a)).all():
            bad = a[~finite]
            raise BundleError(
                f"{path}: tensor '{name}' holds {int(np.isnan(bad).sum())} NaN and {int(np.isinf(bad).sum())} "
                f"infinite value(s) of {a.size}: every score would be NaN; {RE_EXPORT}"
            )
    return warnings


def load_bundle(path: str | Path, *, metadata_only_without_plugin: bool = False) -> Bundle:
    """Rebuild a bundle's detectors from its file (weights by safetensors, no pickles), after
    checking its metadata, its digest and its weights (module docstring). A plugin's bundle whose
    plugin is not registered here is a `PluginError` saying how to register it; with
    `metadata_only_without_plugin` (`halludetect show`) it is loaded without detectors instead,
    every check but the rebuild done, with a warning saying so."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such bundle (the export stage writes data/bundles/<model>/<dataset>/<method>.safetensors)"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except (SafetensorError, OSError) as e:
        raise BundleError(f"{path}: not a readable safetensors file ({e})") from None
    if raw is None:
        raise BundleError(
            f"{path}: a safetensors file without bundle metadata (a single detector file? "
            "bundles come from the export stage)"
        )
    try:
        meta = json.loads(raw)
    except ValueError as e:  # JSONDecodeError; also NaN spelt out, which the export never writes
        raise BundleError(f"{path}: the bundle metadata is not valid JSON ({e}): damaged; {RE_EXPORT}") from None
    meta = check_meta(path, meta)
    warnings = check_tensors(path, meta, tensors) + format_warnings(path, meta)
    try:
        check_known(meta, path)  # a plugin's method: registered here, or named with how to register it
    except PluginError as e:
        if not metadata_only_without_plugin:
            raise
        warnings.append(f"{e} to score it; shown from its metadata (its weights are checked, not rebuilt)")
        return Bundle(meta=meta, detectors={}, path=path, sha256=file_sha256(path), warnings=warnings)
    detectors = {}
    try:
        method_params = params_for(meta["method"], meta["params"])
    except ValidationError as e:
        problems = "; ".join(f"'params.{_key(err['loc'])}': {err['msg'].lower()}" for err in e.errors())
        raise BundleError(f"{path}: bundle metadata {problems}: {RE_EXPORT}") from None
    except UnknownName as e:
        raise BundleError(f"{path}: bundle metadata 'method': {e}") from None
    for seed in meta["seeds"]:
        prefix = f"seed_{seed}."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        model = build_detector(meta["method"], int(meta["d"]), method_params)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise BundleError(
                f"{path}: seed {seed}'s weights do not fit a '{meta['method']}' detector "
                f"({str(e).splitlines()[0]}): re-export it"
            ) from None
        detectors[int(seed)] = model.eval()
    return Bundle(meta=meta, detectors=detectors, path=path, sha256=file_sha256(path), warnings=warnings)


# ------------------------------------------------------------------ export from the DAG's outputs
def ensemble_scores(scores: pl.DataFrame, split: str, seeds: list[int], source: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels [n] and the mean of the seeds' logits [n] of one split's responses, from the
    per-layer scores table (one row per response and seed)."""
    part = scores.filter(pl.col("split") == split)
    have = sorted(part["seed"].unique().to_list())
    if have != sorted(seeds):
        raise DataError(
            f"{source}: the {split} scores hold seeds {have}, the evaluation averaged {sorted(seeds)}: "
            "re-run train and evaluate"
        )
    wide = part.pivot(on="seed", index=["response_id", "label"], values="score", aggregate_function=None)
    cols = [str(s) for s in seeds]
    if wide[cols].null_count().sum_horizontal().item():
        raise DataError(f"{source}: some {split} responses lack a score for some seed: re-run evaluate")
    wide = wide.sort("response_id")
    z = wide.select(pl.mean_horizontal([pl.col(c).cast(pl.Float64) for c in cols])).to_series().to_numpy()
    return wide["label"].to_numpy().astype(np.int64), z


def check_scores_match_metrics(scores: pl.DataFrame, metrics: dict, layer: int, source: str) -> None:
    """The scores table and the metrics JSON must come from the same evaluation."""
    row = next((r for r in metrics["layers"] if r["layer"] == layer), None)
    if row is None:
        raise DataError(f"{source}: the metrics list no layer {layer}")
    per_seed = []
    for _, part in scores.filter(pl.col("split") == "val").group_by("seed"):
        per_seed.append(auroc(part["label"].to_numpy(), part["score"].to_numpy()))
    if abs(float(np.mean(per_seed)) - row["val_auroc"]) > 1e-4:
        raise DataError(
            f"{source}: validation AUROC {np.mean(per_seed):.6f} from the scores, "
            f"{row['val_auroc']:.6f} in the metrics: they come from different runs; re-run evaluate"
        )


def p_sem_inputs(method: str, params: dict, given: dict | None) -> dict:
    """{"p_sem": ...} for a method that reads P_sem: which variant and lam (its params), and how
    many answers per question and which clustering made it (`given`); {} for the others."""
    if method not in SP_METHODS:
        return {}
    if not given or "samples_per_question" not in given:
        raise DataError(
            f"'{method}' reads P_sem: its bundle must say how P_sem was made (K answers per question, "
            "the clustering); pass p_sem_input"
        )
    return {"p_sem": {"variant": params["p_sem"], "lam": params["lam"], **given}}


def p_sem_requirement(meta: dict) -> str | None:
    """What a bundle's input rows need as p_sem, in words (None: the method reads none)."""
    if meta.get("method") not in SP_METHODS:
        return None
    info = meta.get("inputs", {}).get("p_sem") or {}
    variant = info.get("variant", meta.get("params", {}).get("p_sem", "?"))
    k = info.get("samples_per_question")
    how = {
        "sum": "summed likelihoods P(A|q), the product of the token probabilities (the paper's formula)",
        "mean": "length-normalised likelihoods exp(mean token log-prob)",
        "count": "the cluster's share of the answers (the HaMI code's)",
    }.get(variant, variant)
    answers = f"K = {k} answers per question" if k else "K not recorded (re-export the bundle)"
    clustering = (
        f", clustered with the {info['equivalence']} equivalence rule ({info['backend']} NLI)"
        if info.get("equivalence")
        else ""
    )
    return (
        f"each row's p_sem: its semantic cluster's probability over {answers}{clustering}, each answer "
        f"weighted by its {how} (P_sem variant '{variant}'); the detector scales states by "
        f"(1 + {info.get('lam', meta.get('params', {}).get('lam', '?'))} p_sem)"
    )


def export_bundle(
    out: str | Path,
    *,
    metrics: dict,
    detectors_dir: str | Path,
    scores_dir: str | Path,
    manifest: dict,
    positions: str,
    states_dtype: str,
    prompt_template: str,
    fpr_targets: list[float],
    default_threshold: str,
    p_sem_input: dict | None = None,
    answers: pl.DataFrame | None = None,
) -> dict:
    """The bundle of an evaluated method's best layer, from the DAG's outputs:
    detectors `<detectors_dir>/layer_LL/seed_S.safetensors`, scores `<scores_dir>/layer_LL.parquet`
    (val and test rows per seed), the evaluation metrics and the model manifest; for a method that
    reads P_sem, `p_sem_input` says how its P_sem was made (K answers per question, the
    clustering; the variant and lam are added from the detector's params). `answers`: the kept
    answers' token log-probs by split (`answer_range.kept_answers`), for the range `score` checks
    rows against; without them the bundle records none. Returns its metadata."""
    layer = int(metrics["best_layer"])
    seeds = [int(s) for s in metrics["seeds"]]
    weights, params, d = {}, None, None
    for seed in seeds:
        f = Path(detectors_dir) / f"layer_{layer}" / f"seed_{seed}.safetensors"
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: the evaluation used seed {seed} at layer {layer}; re-run train")
        model, meta = load_detector(f)
        if meta["method"] != metrics["method"] or int(meta["layer"]) != layer:
            raise DataError(
                f"{f} holds a '{meta['method']}' detector of layer {meta['layer']}, not "
                f"'{metrics['method']}' of layer {layer}: re-run train"
            )
        if params is not None and (meta["params"] != params or int(meta["d"]) != d):
            raise DataError(f"{f}: trained with other params than seed {seeds[0]}'s: re-run train")
        params, d = meta["params"], int(meta["d"])
        weights[seed] = model.state_dict()
    if d != int(manifest["hidden_size"]):
        raise DataError(
            f"detectors of d={d} for a model of hidden size {manifest['hidden_size']}: "
            "the manifest and the detectors come from different models"
        )
    scores_path = Path(scores_dir) / f"layer_{layer}.parquet"
    scores = pl.read_parquet(scores_path)
    check_scores_match_metrics(scores, metrics, layer, str(scores_path))
    y_val, z_val = ensemble_scores(scores, "val", seeds, str(scores_path))
    y_test, z_test = ensemble_scores(scores, "test", seeds, str(scores_path))
    for split, y in (("val", y_val), ("test", y_test)):
        if y.min() == y.max():
            raise DataError(
                f"{scores_path}: every {split} answer is {'hallucinated' if y[0] else 'correct'}: a flag "
                "threshold's false- and true-positive rates need both; re-run judge and train"
            )
    # export.threshold may name a rate that fpr_targets does not list: it is stored too
    targets = sorted({*fpr_targets, *([float(default_threshold[4:])] if default_threshold != "best_f1" else [])})
    thresholds = choose_thresholds(y_val, z_val, targets, (y_test, z_test))
    if default_threshold not in thresholds:
        raise DataError(f"export.threshold '{default_threshold}' is none of {sorted(thresholds)}")
    preset = manifest["preset"]
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": metrics["method"],
        **({"origin": o} if (o := origin_meta(metrics["method"])) else {}),
        "params": params,
        "d": d,
        "layer": layer,
        "n_layers": int(manifest["num_hidden_layers"]),
        "base_model": {
            "name": manifest["name"],
            "path": preset["path"],
            "revision": preset.get("revision"),
            "resolved_revision": manifest.get("resolved_revision"),
            "files": manifest.get("files"),
            "hidden_size": int(manifest["hidden_size"]),
            "num_hidden_layers": int(manifest["num_hidden_layers"]),
            "preset": preset,
        },
        "inputs": {
            "positions": positions,
            "prompt_template": prompt_template,
            "prompt_hash": template_hash(prompt_template),
            "chat_template": bool(preset["chat_template"]),
            "states_dtype": states_dtype,
            **p_sem_inputs(metrics["method"], params, p_sem_input),
        },
        "seeds": seeds,
        "combine": COMBINE,
        "thresholds": thresholds,
        "default_threshold": default_threshold,
        "calibration": fit_platt(y_val, z_val),
        "evaluation": {
            "dataset": metrics.get("dataset"),
            "test_auroc_dag": metrics["test"]["auroc"],
            "val_auroc_ensemble": float(auroc(y_val, z_val)),
            "test_auroc_ensemble": float(auroc(y_test, z_test)),
            "n_val": int(len(y_val)),
            "n_test": int(len(y_test)),
            "n_val_hallucinated": int(y_val.sum()),
            "n_test_hallucinated": int(y_test.sum()),
            "layer_selection": metrics.get("layer_selection", "highest mean validation AUROC over seeds"),
        },
    }
    if answers is not None:
        meta["answer_range"] = answer_range(answers)
    save_bundle(out, weights, meta)
    return meta

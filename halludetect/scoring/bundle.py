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

A score with nothing to train (methods/scores.py) has a bundle of its own kind: no weights, its
metadata says `kind: "score"` in its own format (score_bundle.py describes it and writes it).
`load_bundle` recognises it and returns a `ScoreBundle`, checked here by `load_score_bundle` with
the same pieces as a detector bundle (types and relations, thresholds' rates, the digest).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
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
    params_for,
)
from halludetect.detectors.evidence import Evidence, NoEvidence, describe, ensemble_evidence
from halludetect.methods import SCORES, SP_METHODS, PluginError
from halludetect.methods import method as lookup_method
from halludetect.methods.spec import Reads
from halludetect.prompts import template_hash

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
    def reads(self) -> Reads:
        """What its method reads besides the bags (methods/spec.py): `p_sem`, each answer's semantic
        probability (HaMI (SP) scales the states by it: inputs must carry it); `question`, the
        question's other answers (EigenScore scores them together, never one answer alone)."""
        return lookup_method(self.method).reads

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
        return platt_probability(self.meta["calibration"], z)

    def threshold(self, choice: str | float | None = None) -> tuple[str, float]:
        """(name, value) of a stored threshold (`best_f1`, `fpr_0.05`, ...), the default one for
        None, or a number given as is."""
        return pick_threshold(self.meta, choice)


def platt_probability(calibration: dict, z: np.ndarray) -> np.ndarray:
    """A bundle's calibrated probability of its scores z [n]: sigmoid(a z + b)."""
    x = calibration["a"] * np.asarray(z, dtype=np.float64) + calibration["b"]
    return np.exp(-np.logaddexp(0.0, -x))  # sigmoid(x), without overflow for |x| > 709


def pick_threshold(meta: dict, choice: str | float | None = None, unit: str = "logit") -> tuple[str, float]:
    """(name, value) of a bundle's stored threshold (`best_f1`, `fpr_0.05`, ...), its default for
    None, or a number given as is; `unit` names what the number is (a logit, or a score bundle's score)."""
    stored = meta["thresholds"]
    if choice is None:
        choice = meta["default_threshold"]
    if isinstance(choice, int | float) and not isinstance(choice, bool):
        name, value = f"{float(choice):g}", float(choice)
    else:
        name, value = str(choice), _number(choice)
    if value is not None:
        if not math.isfinite(value):
            raise BundleError(
                f"threshold {choice!r} is not a finite {unit}: give one this bundle stores "
                f"({', '.join(sorted(stored))}) or a finite number"
            )
        return name, value
    if choice not in stored:
        raise BundleError(
            f"unknown threshold '{choice}': this bundle has {', '.join(sorted(stored))}, or give a {unit} value"
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
    tensors = {f"seed_{seed}.{k}": v for seed, sd in detectors.items() for k, v in sd.items()}
    write_bundle_file(path, tensors, meta | {"format": FORMAT, "format_version": FORMAT_VERSION})


def write_bundle_file(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Any bundle's file (a detector's or a score's, score_bundle.py), written atomically: the
    tensors, and `meta` as one sorted JSON entry with the digest of both (any digest in it replaced)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {k: v for k, v in meta.items() if k != "digest"}
    meta["digest"] = {
        "algorithm": "sha256",
        "tensors": {name: tensor_digest(t) for name, t in sorted(tensors.items())},
        "metadata": metadata_digest(meta),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta, sort_keys=True, allow_nan=False)})


SCORE_FORMAT = "halludetect-score-bundle"  # a score with nothing to train: score_bundle.py


def is_score_meta(meta: dict) -> bool:
    """A score bundle's metadata (kind "score", its own format): checked by score_bundle.py, not here."""
    return meta.get("kind") == "score" or meta.get("format") == SCORE_FORMAT


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
    validate_meta(path, meta, BundleMeta)
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
    problems += threshold_problems(meta["thresholds"], rates=meta["format_version"] >= 3)
    if meta["format_version"] >= 3:
        missing = [k for k in V3_EVALUATION_KEYS if meta["evaluation"].get(k) is None]
        problems += [f"'evaluation.{k}' is missing (format 3 records it)" for k in missing]
    if problems:
        raise BundleError(f"{path}: bundle metadata {'; '.join(problems)}: {RE_EXPORT}")
    return meta


# What format 3 added: each threshold's rates on validation and test, each split's hallucinated count.
V3_THRESHOLD_KEYS = ("val_fpr", "val_tpr", "test_fpr", "test_tpr")
V3_EVALUATION_KEYS = ("n_val", "n_test", "n_val_hallucinated", "n_test_hallucinated")


def validate_meta(path: Path, meta: dict, shape: type[BaseModel]) -> None:
    """The metadata's types and shapes against `shape`: a `BundleError` naming the bundle and every
    key that is wrong."""
    try:
        shape.model_validate(meta)
    except ValidationError as e:
        problems = [
            f"'{_key(err['loc'])}': {err['msg'].lower()}"
            + ("" if err["type"] == "missing" else f" (got {json.dumps(err['input'])[:60]})")
            for err in e.errors()
        ]
        raise BundleError(f"{path}: bundle metadata {'; '.join(problems)}: {RE_EXPORT}") from None


def threshold_problems(thresholds: dict, *, rates: bool) -> list[str]:
    """How the thresholds fit their names and rates; with `rates` (format 3, score bundles), that
    each records its validation and test rates."""
    problems = []
    for name, entry in sorted(thresholds.items()):
        if rates:
            missing = [k for k in V3_THRESHOLD_KEYS if entry.get(k) is None]
            problems += [f"'thresholds.{name}.{k}' is missing (format 3 records it)" for k in missing]
        target = entry.get("target_fpr")
        if name.startswith("fpr_") and (target is None or threshold_name(target) != name):
            problems.append(f"'thresholds.{name}.target_fpr' is {target!r}, not the rate its name says")
        elif target is not None and entry.get("val_fpr") is not None and entry["val_fpr"] > target:
            problems.append(f"'thresholds.{name}.val_fpr' {entry['val_fpr']:g} is above its 'target_fpr' {target:g}")
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


def load_bundle(path: str | Path, *, metadata_only_without_plugin: bool = False) -> Bundle | ScoreBundle:
    """Rebuild a bundle's detectors from its file (weights by safetensors, no pickles), after
    checking its metadata, its digest and its weights (module docstring). A plugin's bundle whose
    plugin is not registered here is a `PluginError` saying how to register it; with
    `metadata_only_without_plugin` (`halludetect show`) it is loaded without detectors instead,
    every check but the rebuild done, with a warning saying so. A score bundle (a score with
    nothing to train, kind "score") is checked and returned by score_bundle.py's `load_score_bundle`."""
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
    if isinstance(meta, dict) and is_score_meta(meta):
        return load_score_bundle(path, meta, tensors)
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


# What each P_sem variant weights an answer by (the pipeline's clusters.parquet p_sem_<variant>).
P_SEM_WEIGHTS = {
    "sum": "summed likelihoods P(A|q), the product of the token probabilities (the paper's formula)",
    "mean": "length-normalised likelihoods exp(mean token log-prob)",
    "count": "the cluster's share of the answers (the HaMI code's)",
}


def p_sem_words(variant: str, k, equivalence: str | None = None, backend: str | None = None) -> str:
    """The P_sem an input row must carry, in words: its variant, K and clustering."""
    answers = f"K = {k} answers per question" if k else "K not recorded (re-export the bundle)"
    clustering = f", clustered with the {equivalence} equivalence rule ({backend} NLI)" if equivalence else ""
    return (
        f"each row's p_sem: its semantic cluster's probability over {answers}{clustering}, each answer "
        f"weighted by its {P_SEM_WEIGHTS.get(variant, variant)} (P_sem variant '{variant}')"
    )


def p_sem_requirement(meta: dict) -> str | None:
    """What a bundle's input rows need as p_sem, in words (None: the method reads none)."""
    if is_score_meta(meta):
        return score_p_sem_requirement(meta)
    if meta.get("method") not in SP_METHODS:
        return None
    info = meta.get("inputs", {}).get("p_sem") or {}
    variant = info.get("variant", meta.get("params", {}).get("p_sem", "?"))
    words = p_sem_words(variant, info.get("samples_per_question"), info.get("equivalence"), info.get("backend"))
    lam = info.get("lam", meta.get("params", {}).get("lam", "?"))
    return f"{words}; the detector scales states by (1 + {lam} p_sem)"


# ======================================================== score bundles (score_bundle.py)
SCORE_FORMAT_VERSION = 1
KIND = "score"
SPLITS = ("val", "test")
P_SEM_VARIANTS = tuple(P_SEM_WEIGHTS)  # sum, mean, count
# The scores `halludetect score` computes for one answer alone, and what from: the row's own p_sem
# column, the base model's tokenizer (no weights), or the base model run teacher forced.
ONE_ANSWER: dict[str, Literal["p_sem", "tokenizer", "model"]] = {
    "p_sem": "p_sem",
    "length": "tokenizer",
    "logprob": "model",
}
# What the others read beyond the answer, in words (from their declaration's `needs`).
NEEDS_WORDS = {
    "sampling": "the question's K sampled answers",
    "sampling + NLI": "the question's K sampled answers and their semantic clustering (NLI)",
    "a forward pass": "one more forward pass of the model over them (asked whether the answer is true)",
    "token log-probs": "the answer's token log-probs",
}


# ------------------------------------------------------------------ the metadata's shape
class ScoreDeclMeta(_Meta):
    name: str
    display: str
    needs: list[str]
    source: Literal["answers", "model"]
    family: str


class ScoreInputsMeta(_Meta):
    prompt_template: str
    prompt_hash: str
    chat_template: bool


class ScoreEvaluationMeta(_Meta):
    val_auroc: FiniteFloat
    test_auroc: FiniteFloat
    n_val: PositiveInt
    n_test: PositiveInt
    n_val_hallucinated: NonNegativeInt
    n_test_hallucinated: NonNegativeInt
    unscored: dict[Literal["val", "test"], NonNegativeInt]


class ScoreRangeMeta(_Meta):
    split: Literal["val"]
    n: PositiveInt
    min: FiniteFloat
    max: FiniteFloat


class ScoreBundleMeta(_Meta):
    """What `load_score_bundle` requires of the metadata, type by type (relations: `check_score_meta`)."""

    format: Literal["halludetect-score-bundle"]
    format_version: Literal[1]
    kind: Literal["score"]
    score: ScoreDeclMeta
    params: dict[str, Any]
    model: str
    dataset: str
    base_model: BaseModelMeta
    inputs: ScoreInputsMeta
    generation: dict[str, Any] | None = None
    thresholds: dict[str, ThresholdMeta] = Field(min_length=1)
    default_threshold: str
    calibration: CalibrationMeta
    evaluation: ScoreEvaluationMeta
    score_range: ScoreRangeMeta
    digest: DigestMeta


# ---------------------------------------------------------------------------- the bundle
@dataclass
class ScoreBundle:
    """A loaded score bundle: its checked metadata (no detectors: nothing was trained)."""

    meta: dict
    path: Path | None = None
    sha256: str | None = None
    warnings: list[str] = field(default_factory=list)
    kind = KIND
    layer = None  # no hidden state is read: what summaries print for a detector's layer

    @property
    def method(self) -> str:
        """The score's name (what messages and summaries name a detector bundle's method by)."""
        return self.meta["score"]["name"]

    @property
    def reads(self) -> str | None:
        """What `halludetect score` computes it from (`ONE_ANSWER`), None for a score it cannot compute."""
        return ONE_ANSWER.get(self.method)

    def refusal(self) -> str | None:
        """Why `halludetect score` cannot compute this score for one answer, or None."""
        if self.reads is not None:
            return None
        decl = self.meta["score"]
        needs = [NEEDS_WORDS.get(n, n) for n in decl["needs"]] or ["more than the answer"]
        return (
            f"{self.path or 'the bundle'} is a score bundle of '{self.method}' ({decl['display']}), which needs "
            f"{' and '.join(needs)}: halludetect score scores one answer at a time, so it cannot compute it. "
            "Evaluate it in the DAG, or score answers with a bundle of p_sem (give each row's p_sem), "
            "logprob, length or a trained detector"
        )

    def probability(self, z: np.ndarray) -> np.ndarray:
        return platt_probability(self.meta["calibration"], z)

    def threshold(self, choice: str | float | None = None) -> tuple[str, float]:
        """(name, value) of a stored threshold, the default for None, or a score value given as is."""
        return pick_threshold(self.meta, choice, unit="score")

    def out_of_range(self, z: float) -> str | None:
        """Why a score lies outside the validation scores', or None."""
        r = self.meta["score_range"]
        side = "below the lowest" if z < r["min"] else "above the highest" if z > r["max"] else None
        if side is None:
            return None
        return (
            f"score {z:.4g} is {side} of the {r['n']:,} validation scores (their range [{r['min']:.4g}, "
            f"{r['max']:.4g}]): the thresholds and calibration were never fitted there"
        )


# What a score bundle can score (the summary of `halludetect score`, docs/scoring.md).
SCORE_CAN_SCORE = (
    "answers given one at a time: p_sem from each row's P_sem, length and logprob from the answer under the "
    "base model (its own answers are the ones the score was measured on: text written elsewhere gets a "
    "score, but on answers unlike those its thresholds were chosen on); each row's in_distribution is false "
    "where the score is outside the validation scores' range"
)
RANGE_RULE = (
    "out of distribution when its score is outside the range of the validation scores that chose the "
    "thresholds and the calibration"
)


def check_score_meta(path: Path, meta: dict) -> dict:
    """A score bundle's metadata: types and shapes, then how its entries fit together; a
    `BundleError` naming the bundle and every key that is wrong."""
    if meta.get("format") != SCORE_FORMAT or meta.get("format_version") != SCORE_FORMAT_VERSION:
        raise BundleError(
            f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r} (kind "
            f"{meta.get('kind')!r}); this halludetect reads score bundles of {SCORE_FORMAT!r} version "
            f"{SCORE_FORMAT_VERSION}"
        )
    validate_meta(path, meta, ScoreBundleMeta)
    problems = threshold_problems(meta["thresholds"], rates=True)
    if meta["default_threshold"] not in meta["thresholds"]:
        problems.append(f"'default_threshold' {meta['default_threshold']!r} is none of 'thresholds'")
    if template_hash(meta["inputs"]["prompt_template"]) != meta["inputs"]["prompt_hash"]:
        problems.append("'inputs.prompt_template' does not match 'inputs.prompt_hash'")
    ev, rng = meta["evaluation"], meta["score_range"]
    for split in SPLITS:
        if ev[f"n_{split}_hallucinated"] > ev[f"n_{split}"]:
            problems.append(f"'evaluation.n_{split}_hallucinated' is above 'evaluation.n_{split}'")
    if rng["n"] != ev["n_val"] or rng["min"] > rng["max"]:
        problems.append(f"'score_range' ({rng['n']} scores in [{rng['min']}, {rng['max']}]) is not the validation's")
    if meta["score"]["name"] == "p_sem" and meta["params"].get("variant") not in P_SEM_VARIANTS:
        problems.append(
            f"'params.variant' is {meta['params'].get('variant')!r}, not one of {', '.join(P_SEM_VARIANTS)}"
        )
    if problems:
        raise BundleError(f"{path}: bundle metadata {'; '.join(problems)}: {RE_EXPORT}")
    return meta


def _check_val_tensors(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The stored validation scores and labels are the ones the metadata describes."""
    z, y = tensors.get("val_score"), tensors.get("val_label")
    ev, rng = meta["evaluation"], meta["score_range"]
    if z is None or y is None or z.shape != (ev["n_val"],) or y.shape != (ev["n_val"],):
        raise BundleError(
            f"{path}: tensors 'val_score' and 'val_label' must hold the {ev['n_val']} validation answers: {RE_EXPORT}"
        )
    z, y = z.double().numpy(), y.numpy()
    if int(y.sum()) != ev["n_val_hallucinated"] or not set(np.unique(y).tolist()) <= {0, 1}:
        raise BundleError(f"{path}: tensor 'val_label' is not 'evaluation.n_val_hallucinated' labels 0/1: {RE_EXPORT}")
    if float(z.min()) != rng["min"] or float(z.max()) != rng["max"]:
        raise BundleError(f"{path}: tensor 'val_score' does not span 'score_range': {RE_EXPORT}")


def load_score_bundle(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> ScoreBundle:
    """A score bundle read by `load_bundle` (its raw metadata and tensors): checked as a detector
    bundle is (types, relations, the digest of every tensor and of the metadata, finite values)."""
    meta = check_score_meta(path, meta)
    warnings = check_tensors(path, meta, tensors)
    _check_val_tensors(path, meta, tensors)
    if meta["score"]["name"] not in SCORES:
        warnings.append(
            f"{path}: the score '{meta['score']['name']}' is not one this halludetect declares "
            "(a newer version's?): it is shown from its metadata, and cannot be scored here"
        )
    return ScoreBundle(meta=meta, path=path, sha256=file_sha256(path), warnings=warnings)


def score_p_sem_requirement(meta: dict) -> str | None:
    """What a p_sem score bundle's input rows need as p_sem, in words (None for the other scores)."""
    if meta.get("score", {}).get("name") != "p_sem":
        return None
    gen = meta.get("generation") or {}
    k = gen.get("samples_per_question", gen.get("n_samples"))
    words = p_sem_words(meta["params"].get("variant", "?"), k, gen.get("equivalence"), gen.get("backend"))
    return f"{words}; the score is 1 - p_sem"

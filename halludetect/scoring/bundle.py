"""A trained detector as one self-contained file: everything `halludetect score` needs to
rebuild the detector's input and read its output.

One safetensors file:

    tensors   every seed's detector weights, named `seed_<S>.<parameter>`
    metadata  one sorted JSON entry, "bundle" (one entry, as in detector files: safetensors
              writes several in no fixed order, and the same bundle must give the same bytes):
      format, format_version
      method, params, d            the detector, rebuilt from the registry (no pickles)
      layer, n_layers              the hidden state it reads (0 = embeddings; n_layers = the
                                   top, which carries the final norm)
      base_model                   preset name, path (hub id or local directory), revision,
                                   and what pins it: the hub commit it resolved to, or the
                                   sha256 of every file of a local model (its manifest),
                                   hidden_size, num_hidden_layers, the full preset
      inputs                       positions convention, prompt template text and hash,
                                   chat_template flag, the dtype the states were stored in
      seeds, combine               "mean_logit": the score is the mean of the seeds' logits
      thresholds, default_threshold  chosen on validation: at target false-positive rates
                                   (`fpr_0.05`, ...) and at the best F1 (`best_f1`)
      calibration                  Platt scaling p = sigmoid(a z + b), fitted on validation
      evaluation                   the DAG's test AUROC at that layer (per seed), the
                                   ensemble's validation and test AUROC

Why an ensemble of the seeds rather than the best one: picking the best seed on test would
select on test; on validation, seeds differ by less than validation's own noise (a few
hundred responses), so "best" mostly picks noise. The mean of the logits of independently
trained detectors has less variance than any one of them, uses every seed the DAG reported,
and costs S detector passes, nothing next to the transformer blocks that produce its input.
Its own test AUROC is measured at export and stored beside the per-seed ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch
from torch import nn

from halludetect.activations.bags import Bags
from halludetect.config import threshold_name
from halludetect.core.atomic_io import atomic_path, file_sha256
from halludetect.core.errors import DataError, UserError
from halludetect.detectors.build import build_detector, load_detector, params_for
from halludetect.detectors.evidence import Evidence, NoEvidence, describe, ensemble_evidence
from halludetect.methods import SP_METHODS
from halludetect.metrics import auroc
from halludetect.prompts import template_hash

FORMAT = "halludetect-bundle"
FORMAT_VERSION = 1
COMBINE = "mean_logit"
META_KEY = "bundle"


class BundleError(UserError, ValueError):
    """A bundle file that cannot be used: not a bundle, damaged, or for another model or input."""


# ------------------------------------------------------------------ thresholds and calibration
def at_threshold(y: np.ndarray, z: np.ndarray, t: float) -> dict:
    """What flagging z >= t does on (y, z): false- and true-positive rates, precision, F1."""
    flag = z >= t
    tp, fp = int((flag & (y == 1)).sum()), int((flag & (y == 0)).sum())
    pos, neg = int((y == 1).sum()), int((y == 0).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / pos
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"threshold": float(t), "val_fpr": fp / neg, "val_tpr": recall, "val_precision": precision, "val_f1": f1}


def choose_thresholds(y: np.ndarray, z: np.ndarray, fpr_targets: list[float]) -> dict[str, dict]:
    """Thresholds on validation logits: the lowest one whose false-positive rate is at most
    each target (flag = z >= threshold), and the one of the best F1."""
    from sklearn.metrics import precision_recall_curve, roc_curve  # export only: scoring never pays the import

    out = {}
    fpr, _, thr = roc_curve(y, z, drop_intermediate=False)  # thr decreasing, thr[0] = inf
    for target in fpr_targets:
        i = int(np.nonzero(fpr <= target)[0][-1])
        # i = 0 only when the highest score is a negative's and one negative is already too
        # many: then no score is flagged, with a finite threshold just above the highest.
        t = float(thr[i]) if i > 0 else float(np.nextafter(z.max(), math.inf))
        out[threshold_name(target)] = {"target_fpr": target, **at_threshold(y, z, t)}
    precision, recall, thr = precision_recall_curve(y, z)
    f1 = np.where(precision + recall > 0, 2 * precision * recall / np.maximum(precision + recall, 1e-300), 0.0)
    best = int(np.argmax(f1[:-1]))  # the last point (recall 0) has no threshold
    out["best_f1"] = at_threshold(y, z, float(thr[best]))
    return out


def fit_platt(y: np.ndarray, z: np.ndarray) -> dict:
    """Platt scaling p = sigmoid(a z + b), an unregularised logistic regression on the logits."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss

    model = LogisticRegression(C=np.inf).fit(z[:, None], y)
    a, b = float(model.coef_[0, 0]), float(model.intercept_[0])
    p = 1 / (1 + np.exp(-(a * z + b)))
    return {
        "method": "platt",
        "a": a,
        "b": b,
        "fitted_on": "val",
        "n": int(len(y)),
        "val_log_loss": float(log_loss(y, p)),
        "val_brier": float(np.mean((p - y) ** 2)),
    }


# ---------------------------------------------------------------------------- the bundle
@dataclass
class Bundle:
    """A loaded bundle: its metadata and one detector per seed (in eval mode)."""

    meta: dict
    detectors: dict[int, nn.Module]
    path: Path | None = None
    sha256: str | None = None
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
        """[S, B] each seed's bag logits, in the order of `seeds`."""
        return torch.stack([self.detectors[s](bags) for s in self.seeds])

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
        return 1 / (1 + np.exp(-(c["a"] * np.asarray(z, dtype=np.float64) + c["b"])))

    def threshold(self, choice: str | float | None = None) -> tuple[str, float]:
        """(name, value) of a stored threshold (`best_f1`, `fpr_0.05`, ...), the default one for
        None, or a number given as is."""
        stored = self.meta["thresholds"]
        if choice is None:
            choice = self.meta["default_threshold"]
        if isinstance(choice, int | float) and not isinstance(choice, bool):
            return f"{float(choice):g}", float(choice)
        try:
            return str(choice), float(choice)
        except ValueError:
            pass
        if choice not in stored:
            raise BundleError(
                f"unknown threshold '{choice}': this bundle has {', '.join(sorted(stored))}, or give a logit value"
            )
        return str(choice), float(stored[choice]["threshold"])


def save_bundle(path: str | Path, detectors: dict[int, dict[str, torch.Tensor]], meta: dict) -> None:
    """Write a bundle atomically: each seed's state dict under `seed_<S>.`, `meta` as one JSON entry."""
    from safetensors.torch import save_file

    tensors = {
        f"seed_{seed}.{k}": v.detach().cpu().contiguous() for seed, sd in detectors.items() for k, v in sd.items()
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta, sort_keys=True, allow_nan=False)})


REQUIRED = (
    "method",
    "params",
    "d",
    "layer",
    "n_layers",
    "base_model",
    "inputs",
    "seeds",
    "combine",
    "thresholds",
    "default_threshold",
    "calibration",
    "evaluation",
)


def load_bundle(path: str | Path) -> Bundle:
    """Rebuild a bundle's detectors from its file (weights by safetensors, no pickles)."""
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
    meta = json.loads(raw)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; this "
            f"halludetect reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise BundleError(f"{path}: bundle metadata lacks {missing}: re-export it")
    if meta["combine"] != COMBINE:
        raise BundleError(f"{path}: unknown seed combination {meta['combine']!r} (this version: {COMBINE!r})")
    detectors = {}
    method_params = params_for(meta["method"], meta["params"])
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
    return Bundle(meta=meta, detectors=detectors, path=path, sha256=file_sha256(path))


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
) -> dict:
    """The bundle of an evaluated method's best layer, from the DAG's outputs:
    detectors `<detectors_dir>/layer_LL/seed_S.safetensors`, scores `<scores_dir>/layer_LL.parquet`
    (val and test rows per seed), the evaluation metrics and the model manifest. Returns its metadata."""
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
    thresholds = choose_thresholds(y_val, z_val, fpr_targets)
    if default_threshold not in thresholds:
        raise DataError(f"export.threshold '{default_threshold}' is none of {sorted(thresholds)}")
    preset = manifest["preset"]
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": metrics["method"],
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
            "layer_selection": metrics.get("layer_selection", "highest mean validation AUROC over seeds"),
        },
    }
    save_bundle(out, weights, meta)
    return meta

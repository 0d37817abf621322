"""The `analyze` stage's work: the sensitivity analysis (sensitivity.py) of a grid cell's trained
HaMI detectors, per layer, split and seed, summarised per class as the paper's appendix tables.

Which scaling is analysed:
  hami_sp  the lam and P_sem variant it was trained with (read from its detector files): the
           only scaling the network ever applies, so the only one whose effect it explains.
  hami     trained without scaling, it applies none; the analysis asks what HaMI (SP)'s scaling
           would do to its margin, with `analyze.hami_lam` (default 1, the paper's lambda, the
           value all the paper's sensitivity tables use) and `analyze.hami_p_sem`.

Outputs: per-response rows (p_sem, Z(0), Z(p_B), C_B, C_B^int, the exact value) and, per layer
and split, per-seed class expectations with their mean over seeds, the margin without and with the
scaling (measured, and predicted from C_B^int), and a check of the path identity
Z(p_B) = Z(0) - p_B C_B^int against a tolerance (analyze.path_tolerance, in logits).

Which top-k set: C_B is the derivative at p = 0, so its top-k tokens are those of the unscaled
logits; C_B^int re-ranks the top-k at every step of the path, from the unscaled logits (p = 0) to
the scaled ones (p = p_B) that HaMI (SP) scores with.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import torch

from halludetect.detectors.data import SplitData
from halludetect.evaluation.plot_data import class_histogram_data
from halludetect.evaluation.sensitivity import bag_sensitivity, class_expectations, margin_change, ratios

VARIANTS = ("c0", "c_int")  # C_B at p = 0, and the path-integrated C_B^int
MARGIN_KEYS = ("unscaled", "scaled", "change", "change_from_c_int", "change_from_c0")


def path_identity(s, steps: int, tolerance: float) -> dict:
    """How far the path-integrated sensitivities are from the exact change: the identity
    Z(p_B) = Z(0) - p_B C_B^int holds exactly for the integral, so its gap on a bag is the
    discretisation error of N steps (largest where the active or top-k set changes often)."""
    scaled = s.p > 0
    gap = np.abs(s.c_int - s.c_exact)[scaled]
    identity = np.abs(s.z_p - (s.z0 - s.p * s.c_int))  # [B] in logits
    worst = float(identity.max()) if identity.size else 0.0
    return {
        "steps": steps,
        "max_abs_c_int_minus_exact": float(gap.max()) if gap.size else None,
        "mean_abs_c_int_minus_exact": float(gap.mean()) if gap.size else None,
        "max_abs_identity_gap": worst,
        "tolerance": tolerance,
        "within_tolerance": bool(worst <= tolerance),
        "bags_over_tolerance": int((identity > tolerance).sum()),
        "bags_with_p_zero": int((~scaled).sum()),
    }


def analyze_split(
    models: dict[int, torch.nn.Module],
    data: SplitData,
    lam: float,
    steps: int,
    batch_size: int = 1024,
    tolerance: float = 0.01,
) -> tuple[pl.DataFrame, dict]:
    """Every seed's sensitivities on one split of one layer: (per-response rows, summary).

    models: seed -> trained HaMI network; data: the split with P_sem of every bag; tolerance: the
    largest gap of the path identity, in logits, that passes without a warning.
    """
    if data.p_sem is None:
        raise ValueError("the analysis needs P_sem of every response (SplitData.p_sem)")
    y = data.y.numpy().astype(np.int64)
    p_sem = data.p_sem.double().numpy()
    frames, per_seed = [], {}
    for seed, model in models.items():
        model.eval()
        parts = [
            bag_sensitivity(
                model, data.slice(a, min(a + batch_size, len(data))), lam * data.p_sem[a : a + batch_size], steps
            )
            for a in range(0, len(data), batch_size)
        ]
        s = type(parts[0])(*(np.concatenate([getattr(p, f) for p in parts]) for f in parts[0].__dataclass_fields__))
        per_seed[str(seed)] = {
            "c0": class_expectations(p_sem, s.c0, y),
            "c_int": class_expectations(p_sem, s.c_int, y),
            "margin": margin_change(s, y),
            "path_check": path_identity(s, steps, tolerance),
            "positive_c_int_share": float(np.mean(s.c_int > 0)),
        }
        frames.append(
            pl.DataFrame(
                {
                    "response_id": data.response_ids,
                    "seed": seed,
                    "label": y,
                    "n_tokens": data.lengths.numpy(),
                    "p_sem": p_sem,
                    "p": s.p,
                    "z0": s.z0,
                    "z_p": s.z_p,
                    "c0": s.c0,
                    "c_int": s.c_int,
                    "c_exact": s.c_exact,
                }
            )
        )
    checks = [r["path_check"] for r in per_seed.values()]
    summary = {
        "n": len(data),
        "n_hallucinated": int(y.sum()),
        "per_seed": per_seed,
        "mean": {v: mean_over_seeds([r[v] for r in per_seed.values()]) for v in VARIANTS},
        "margin": {k: float(np.mean([r["margin"][k] for r in per_seed.values()])) for k in MARGIN_KEYS},
        "path_check": {
            "max_abs_identity_gap": max(c["max_abs_identity_gap"] for c in checks),
            "tolerance": tolerance,
            "within_tolerance": all(c["within_tolerance"] for c in checks),
        },
    }
    return pl.concat(frames), summary


def _mean(values: list) -> float | None:
    return None if any(v is None for v in values) else float(np.mean(values))


def mean_over_seeds(per_seed: list[dict]) -> dict:
    """Class expectations averaged over seeds, and gamma, 1/gamma and the condition computed from
    those means (so a table's ratios are those of the expectations it shows); each seed's own
    gamma is kept for the spread, and the condition is counted over seeds: [holds, applies]."""
    out = {
        cls: {k: _mean([s[cls][k] for s in per_seed]) for k in ("p_sem", "c", "p_sem_c")} | {"n": per_seed[0][cls]["n"]}
        for cls in ("neg", "pos")
    }
    out |= ratios(out["neg"], out["pos"])
    out["gamma_per_seed"] = [s["gamma"] for s in per_seed]
    out["condition_holds_seeds"] = [
        sum(s["condition_holds"] is True for s in per_seed),
        sum(s["condition_applies"] for s in per_seed),
    ]
    out["margin_widens_seeds"] = [sum(s["margin_widens"] for s in per_seed), len(per_seed)]
    return out


# histograms' quantities as a chart's panels name them
QUANTITY = {"c_int": "C_B^int", "p_sem_c_int": "P_sem C_B^int", "c0": "C_B", "p_sem_c0": "P_sem C_B"}


def histograms(rows: pl.DataFrame, bins: int) -> dict[str, pl.DataFrame]:
    """Density per class of C_B^int, P_sem C_B^int, C_B and P_sem C_B (all seeds pooled), on shared
    bins: long-format frames (value, series, density) for DVC's `series` plot template."""
    quantities = {
        "c_int": rows["c_int"],
        "p_sem_c_int": rows["p_sem"] * rows["c_int"],
        "c0": rows["c0"],
        "p_sem_c0": rows["p_sem"] * rows["c0"],
    }
    label = rows["label"].to_numpy()
    return {name: class_histogram_data(values.to_numpy(), label, bins) for name, values in quantities.items()}

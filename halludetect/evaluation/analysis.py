"""The `analyze` stage's work: the sensitivity analysis (sensitivity.py) of a grid cell's trained
HaMI detectors, per layer, split and seed, summarised per class as the paper's appendix tables.

Which scaling is analysed:
  hami_sp  the lam and P_sem variant it was trained with (read from its detector files): the
           only scaling the network ever applies, so the only one whose effect it explains.
  hami     trained without scaling, it applies none; the analysis asks what HaMI (SP)'s scaling
           would do to its margin, with `analyze.hami_lam` (default 1, the paper's lambda, the
           value all the paper's sensitivity tables use) and `analyze.hami_p_sem`.

Outputs: per-response rows (p_sem, Z(0), Z(p_B), C_B, C_B^int, the exact value) and, per layer
and split, per-seed class expectations with their mean over seeds.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import torch

from halludetect.detectors.data import SplitData
from halludetect.evaluation.plot_data import class_histogram_data
from halludetect.evaluation.sensitivity import bag_sensitivity, class_expectations, margin_change, ratios

VARIANTS = ("c0", "c_int")  # C_B at p = 0, and the path-integrated C_B^int


def analyze_split(
    models: dict[int, torch.nn.Module], data: SplitData, lam: float, steps: int, batch_size: int = 1024
) -> tuple[pl.DataFrame, dict]:
    """Every seed's sensitivities on one split of one layer: (per-response rows, summary).

    models: seed -> trained HaMI network; data: the split with P_sem of every bag.
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
        scaled = s.p > 0
        gap = np.abs(s.c_int - s.c_exact)[scaled]
        per_seed[str(seed)] = {
            "c0": class_expectations(p_sem, s.c0, y),
            "c_int": class_expectations(p_sem, s.c_int, y),
            "margin": margin_change(s, y),
            "path_check": {
                "steps": steps,
                "max_abs_c_int_minus_exact": float(gap.max()) if gap.size else None,
                "mean_abs_c_int_minus_exact": float(gap.mean()) if gap.size else None,
                "bags_with_p_zero": int((~scaled).sum()),
            },
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
    summary = {
        "n": len(data),
        "n_hallucinated": int(y.sum()),
        "per_seed": per_seed,
        "mean": {v: mean_over_seeds([r[v] for r in per_seed.values()]) for v in VARIANTS},
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

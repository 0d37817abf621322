"""Comparison tables (Markdown and LaTeX) built from the evaluation metrics JSON alone.

Rows are methods, columns grid cells (model / dataset). Where the paper published a figure
for the same cell and method, it is printed beside ours as "ours (paper X)".
"""

from __future__ import annotations

import json
from pathlib import Path

# Published test figures (paper, tables "AUC comparison" and "Margin comparison"), 5 seeds.
# Cells are keyed by this project's preset names.
_CELLS = [(m, d) for m in ("llama3-8b", "mistral-nemo-12b", "llama3.3-70b")
          for d in ("trivia_qa", "squad", "nq", "bioasq")]
_PAPER_ROWS = {
    "auroc": {  # tables "AUC comparison", "raw vs extracted features", "pooling methods", "P_sem AUC"
        "hami": [0.866, 0.795, 0.777, 0.862, 0.917, 0.840, 0.830, 0.873, 0.907, 0.841, 0.862, 0.888],
        "hami_sp": [0.923, 0.844, 0.840, 0.903, 0.927, 0.858, 0.864, 0.902, 0.914, 0.874, 0.885, 0.896],
        "mean": [0.906, 0.817, 0.792, 0.892, 0.929, 0.846, 0.841, 0.890, 0.913, 0.854, 0.870, 0.904],
        "max": [0.928, 0.829, 0.814, 0.904, 0.945, 0.859, 0.859, 0.897, 0.945, 0.874, 0.889, 0.917],
        "raw_mean": [0.907, 0.817, 0.792, 0.893, 0.929, 0.846, 0.841, 0.889, 0.912, 0.855, 0.871, 0.903],
        "raw_max": [0.900, 0.810, 0.784, 0.877, 0.934, 0.840, 0.838, 0.880, 0.908, 0.850, 0.862, 0.894],
        "attention": [0.919, 0.827, 0.806, 0.887, 0.944, 0.858, 0.861, 0.901, 0.938, 0.869, 0.885, 0.910],
        "gated_attention": [0.912, 0.823, 0.798, 0.888, 0.944, 0.857, 0.859, 0.900, 0.933, 0.858, 0.881, 0.912],
        "p_sem": [0.883, 0.812, 0.800, 0.840, 0.812, 0.802, 0.794, 0.843, 0.832, 0.817, 0.807, 0.810],
    },
    "margin": {
        "hami": [6.17, 2.09, 3.16, 4.28, 5.97, 3.66, 3.42, 4.33, 5.12, 3.67, 3.56, 4.06],
        "hami_sp": [9.02, 5.10, 5.58, 7.51, 7.08, 5.48, 5.25, 5.61, 6.10, 5.47, 5.23, 5.85],
        "mean": [2.026, 0.935, 0.870, 1.286, 2.994, 1.197, 1.046, 1.614, 3.333, 1.222, 1.427, 1.596],
        "max": [2.299, 1.073, 1.052, 1.498, 3.404, 1.420, 1.231, 1.924, 3.722, 1.366, 1.640, 1.824],
    },
    "throughput": {  # samples/s on one A100 (tables "Inference throughput", "Throughput ... pooling")
        "hami": [3612, 3402, 4096, 4096, 4025, 3092, 2886, 2378, 2349, 2436, 2315, 2208],
        "hami_sp": [0.17, 0.09, 0.10, 0.17, 0.28, 0.12, 0.22, 0.13, 0.14, 0.10, 0.18, 0.19],
        "mean": [5192, 5274, 5224, 4649, 5068, 4237, 3706, 3657, 2680, 2637, 2625, 2402],
        "max": [5446, 5303, 4992, 5351, 5202, 4288, 3720, 3512, 2707, 2585, 2602, 2363],
        "attention": [4394, 4469, 4285, 4356, 4295, 3673, 3367, 3303, 2537, 2453, 2404, 2247],
        "gated_attention": [3852, 3728, 3741, 3621, 3584, 2713, 2270, 2247, 1548, 1470, 1452, 1361],
    },
}
PAPER = {
    metric: {method: dict(zip(_CELLS, values)) for method, values in rows.items()}
    for metric, rows in _PAPER_ROWS.items()
}
METRICS = {
    "auroc": "Test AUROC",
    "margin": "Test logit-space margin mean(y z)",
    "throughput": "Inference throughput, samples/s (preloaded tensors / end to end from HDF5; HaMI (SP) with "
                  "its extra sampling and NLI)",
}


NOTES = {
    "auroc": "best layer on validation as (L..); mean ± standard error over seeds; [bootstrap 95% interval]",
    "margin": "best layer on validation as (L..); mean ± standard error over seeds; HaMI's instance-based "
              "logits and the embedding-based ones are on different scales",
    "throughput": "this machine, the best layer's test responses; the paper's figures are one A100's",
}


def load_metrics(directory: str | Path, models: list[str], datasets: list[str], methods: list[str],
                 baselines_dir: str | Path | None = None, baselines: list[str] = ()) -> dict:
    """Metrics of exactly the grid's cells: a missing file is an error, a stale one is ignored."""
    out, missing = {}, []
    for m in models:
        for d in datasets:
            for method in methods:
                path = Path(directory) / m / d / f"{method}.json"
                if path.exists():
                    out[(m, d, method)] = json.loads(path.read_text())
                else:
                    missing.append(str(path))
            if baselines:
                path = Path(baselines_dir) / m / f"{d}.json"
                found = json.loads(path.read_text()) if path.exists() else {}
                for name in baselines:
                    if name in found:
                        out[(m, d, name)] = found[name]
                    else:
                        missing.append(f"{path} [{name}]")
    if missing:
        raise FileNotFoundError(f"metrics missing for {len(missing)} grid cell(s): {missing[:5]}; run evaluate "
                                "and baselines first")
    return out


def _fmt(entry: dict, metric: str) -> str:
    if metric == "throughput":
        if entry.get("family") == "baseline":
            return "-"
        t = entry["throughput"]
        text = f"{t['preloaded_samples_per_s']:,.0f} / {t['end_to_end_samples_per_s']:,.0f}"
        if "cost" in entry:
            text += f"; with sampling and NLI {entry['cost']['samples_per_s_with_sampling_and_nli']:.3g}"
        return text
    stat = entry["test"][metric]
    if stat is None:
        return "-"  # a baseline score is not a logit: no margin
    text = f"{stat['mean']:.3f}"
    if stat.get("stderr") is not None:
        text += f" ± {stat['stderr']:.3f}"
    if metric == "auroc" and entry["test"].get("auroc_ci95"):
        lo, hi = entry["test"]["auroc_ci95"]
        text += f" [{lo:.3f}, {hi:.3f}]"
    return text


def table(metrics: dict, metric: str, models, datasets, methods, latex: bool = False) -> str:
    cells = [(m, d) for m in models for d in datasets]
    header = ["method", *[f"{m} / {d}" for m, d in cells]]
    rows = []
    for method in methods:
        row = [method]
        for m, d in cells:
            entry = metrics[(m, d, method)]
            text = _fmt(entry, metric)
            if entry.get("best_layer") is not None and metric != "throughput":
                text += f" (L{entry['best_layer']})"
            paper = PAPER.get(metric, {}).get(method, {}).get((m, d))
            if paper is not None:
                text += f" (paper {paper})"
            row.append(text)
        rows.append(row)
    if latex:
        esc = lambda s: s.replace("_", r"\_").replace("±", r"$\pm$")  # noqa: E731
        lines = [
            r"\begin{tabular}{l" + "c" * len(cells) + "}",
            r"\toprule",
            " & ".join(esc(h) for h in header) + r" \\",
            r"\midrule",
            *(" & ".join(esc(c) for c in r) + r" \\" for r in rows),
            r"\bottomrule",
            r"\end{tabular}",
        ]
        return "\n".join(lines) + "\n"
    lines = [
        f"**{METRICS[metric]}** ({NOTES[metric]})",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


def summary(metrics: dict) -> dict:
    return {
        f"{m}/{d}/{method}": {
            "best_layer": e["best_layer"],
            "test_auroc": e["test"]["auroc"]["mean"],
            "test_margin": e["test"]["margin"]["mean"] if e["test"]["margin"] else None,
            "test_auroc_ci95": e["test"].get("auroc_ci95"),
            "samples_per_s": e["throughput"]["preloaded_samples_per_s"] if "throughput" in e else None,
        }
        for (m, d, method), e in sorted(metrics.items())
    }

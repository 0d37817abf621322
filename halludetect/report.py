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
    "auroc": {
        "hami": [0.866, 0.795, 0.777, 0.862, 0.917, 0.840, 0.830, 0.873, 0.907, 0.841, 0.862, 0.888],
        "hami_sp": [0.923, 0.844, 0.840, 0.903, 0.927, 0.858, 0.864, 0.902, 0.914, 0.874, 0.885, 0.896],
        "mean": [0.906, 0.817, 0.792, 0.892, 0.929, 0.846, 0.841, 0.890, 0.913, 0.854, 0.870, 0.904],
        "max": [0.928, 0.829, 0.814, 0.904, 0.945, 0.859, 0.859, 0.897, 0.945, 0.874, 0.889, 0.917],
    },
    "margin": {
        "hami": [6.17, 2.09, 3.16, 4.28, 5.97, 3.66, 3.42, 4.33, 5.12, 3.67, 3.56, 4.06],
        "hami_sp": [9.02, 5.10, 5.58, 7.51, 7.08, 5.48, 5.25, 5.61, 6.10, 5.47, 5.23, 5.85],
        "mean": [2.026, 0.935, 0.870, 1.286, 2.994, 1.197, 1.046, 1.614, 3.333, 1.222, 1.427, 1.596],
        "max": [2.299, 1.073, 1.052, 1.498, 3.404, 1.420, 1.231, 1.924, 3.722, 1.366, 1.640, 1.824],
    },
}
PAPER = {
    metric: {method: dict(zip(_CELLS, values)) for method, values in rows.items()}
    for metric, rows in _PAPER_ROWS.items()
}
METRICS = {"auroc": "Test AUROC", "margin": "Test logit-space margin mean(y z)"}


def load_metrics(directory: str | Path, models: list[str], datasets: list[str], methods: list[str]) -> dict:
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
    if missing:
        raise FileNotFoundError(f"metrics missing for {len(missing)} grid cell(s): {missing[:5]}; run evaluate first")
    return out


def _fmt(entry: dict, metric: str) -> str:
    stat = entry["test"][metric]
    digits = 3
    text = f"{stat['mean']:.{digits}f}"
    if stat.get("stderr") is not None:
        text += f" ± {stat['stderr']:.{digits}f}"
    return text


def table(metrics: dict, metric: str, models, datasets, methods, latex: bool = False) -> str:
    cells = [(m, d) for m in models for d in datasets]
    header = ["method", *[f"{m} / {d}" for m, d in cells]]
    rows = []
    for method in methods:
        row = [method]
        for m, d in cells:
            entry = metrics[(m, d, method)]
            text = f"{_fmt(entry, metric)} (L{entry['best_layer']})"
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
        f"**{METRICS[metric]}** (best layer on validation in parentheses; mean ± standard error over seeds)",
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
            "test_margin": e["test"]["margin"]["mean"],
            "test_auroc_ci95": e["test"].get("auroc_ci95"),
        }
        for (m, d, method), e in sorted(metrics.items())
    }

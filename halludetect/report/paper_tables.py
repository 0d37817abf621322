"""The paper's tables rebuilt from our metrics JSON, one Markdown and one LaTeX file per table.

Each table follows the layout of the paper's table it reproduces (rows, columns, grouping), with
our figure in every cell and the paper's published figure beside it in parentheses where the
paper has that cell. Cells are matched through the paper's identity of the model (hub id) and
dataset (loader), never through preset names (paper.py). Best in bold, second underlined, within
each column (within each family where the paper compares families separately, as for margins).

  auroc               tab:performance_comparison   HaMI, HaMI (SP), mean, max
  raw_vs_extracted    tab:raw_vs_reduced           pooling raw states vs extracted features
  pooling_auroc       tab:pooling_auc              attention, gated attention, mean, max
  p_sem_auroc         tab:se_sp_auc                P_sem as a detector (datasets x models)
  throughput          tab:throughput_comparison    samples/s; HaMI (SP) amortised and sequential
  pooling_speed       tab:pooling_speed            samples/s of the poolings
  margin              tab:margin_comparison        mean(y z) in logit space
  sd_auroc, sd_margin tab:std, tab:std_margin      standard deviation over seeds
  label_distribution  tab:label_dist               positives, negatives, |S_neg| / |S_pos|
  expected_<C>_<m>_<split>  tab:exp_*              E[P_sem], E[C], E[P_sem C], gamma, 1/gamma, condition
  sweep tables        tab:dim_max_*                sweep_table(), for sweep results given to it
and, beyond the paper: every method and baseline by AUROC, PRR and FPR at 95% TPR, and the
margins by answer length.

This module loads the metrics and builds every table (`build_tables`) and the summary; each
family is a module of its own: detection_tables (AUROC, PRR, FPR@95, SD, throughput, P_sem, labels,
training time), margin_tables (margins, their growth, by length), analysis_tables (the tab:exp_*
analysis), sweep_tables; what they share (the grid's cells, names, caption conventions) is
cells.py. The table model and its Markdown/LaTeX rendering are in tables.py.

The field's baselines (SAPLMA, the semantic-entropy probes, EigenScore, p(True), lexical
similarity, the number of semantic sets, semantic entropy, ...) and a user's own detectors
(plugins) stand in blocks of their own under the paper's methods in the main comparison
(`auroc`), in the PRR and FPR@95 tables and in the throughput table, each row marked with what
it needs [labels, sampling, NLI, hidden states] and each cell with its cost per response (the
`cost_per_response` its stage measured: its own scoring plus the samples, NLI calls or forward
pass it needs, amortised).
"""

from __future__ import annotations

import json
from pathlib import Path

from halludetect.report import paper
from halludetect.report.analysis_tables import expected_tables
from halludetect.report.cells import Grid, blocks, family
from halludetect.report.detection_tables import (
    label_table,
    method_table,
    p_sem_table,
    sd_table,
    throughput_table,
    training_time_table,
)
from halludetect.report.margin_tables import length_table, margin_growth_table, margin_table
from halludetect.report.tables import Table, rank


# -------------------------------------------------------------------- loading, building
def load_metrics(directory: str | Path, models: list[str], datasets: list[str], detectors: list[str]) -> dict:
    """Metrics of exactly the grid's cells, `<directory>/<m>/<d>/<detector>.json` (the evaluate
    stage's, for a trained method and a score alike): a missing file is an error, a stale one is ignored."""
    out, missing = {}, []
    for m in models:
        for d in datasets:
            for name in detectors:
                path = Path(directory) / m / d / f"{name}.json"
                if path.exists():
                    out[(m, d, name)] = json.loads(path.read_text())
                else:
                    missing.append(str(path))
    if missing:
        raise FileNotFoundError(f"metrics missing for {len(missing)} grid cell(s): {missing[:5]}; run evaluate first")
    return out


def load_per_cell(
    directory: str | Path, models: list[str], datasets: list[str], methods: list[str] | None = None
) -> dict:
    """{(m, d[, method]): JSON} from <dir>/<m>/<d>.json or <dir>/<m>/<d>/<method>.json; all must exist."""
    out, missing = {}, []
    for m in models:
        for d in datasets:
            for method in methods or [None]:
                path = Path(directory) / m / (f"{d}.json" if method is None else f"{d}/{method}.json")
                if path.exists():
                    out[(m, d) if method is None else (m, d, method)] = json.loads(path.read_text())
                else:
                    missing.append(str(path))
    if missing:
        raise FileNotFoundError(f"{len(missing)} file(s) missing: {missing[:5]}; run the stages that write them")
    return out


def load_analysis(eval_dir: str | Path, models: list[str], datasets: list[str], methods: list[str]) -> dict:
    """{(m, d, method): analysis JSON}: analyze writes beside evaluate, in <eval_dir>/<m>/<d>/analysis/
    (a directory every grid has, so the report's dependency exists even when nothing is analysed)."""
    found = load_per_cell(eval_dir, models, datasets, [f"analysis/{m}" for m in methods]) if methods else {}
    return {(m, d, method.removeprefix("analysis/")): a for (m, d, method), a in found.items()}


def build_tables(metrics: dict, grid: Grid, labels: dict | None = None, analysis: dict | None = None) -> list[Table]:
    detectors = sorted({k[2] for k, e in metrics.items() if e.get("family") == "detector"})
    baselines = sorted({k[2] for k, e in metrics.items() if e.get("family") == "baseline"})
    everything = [*detectors, *baselines]
    others = [m for m in everything if family(m) != "paper"]
    four = [
        ("hami", "instance", False),
        ("hami_sp", "instance", False),
        ("mean", "embedding", True),
        ("max", "embedding", True),
    ]
    tables = [
        method_table(
            "auroc",
            "Test AUROC, best layer on validation, mean ± standard error over seeds [bootstrap 95% "
            "interval, questions resampled]",
            metrics,
            grid,
            [(m, "all", rule) for m, _, rule in four] + blocks(others, metrics, rule_first=True),
            "auroc",
            paper.AUROC,
            with_ci=True,
            notes=["below the rule: the field's baselines and your detectors, [what each needs], cost per response"]
            if others
            else (),
        ),
        method_table(
            "raw_vs_extracted",
            "Test AUROC by the input to the pooling: raw hidden states (d) or the extracted features (D)",
            metrics,
            grid,
            [("raw_mean", "all", False), ("raw_max", "all", False), ("mean", "all", True), ("max", "all", False)],
            "auroc",
            paper.RAW_VS_EXTRACTED,
        ),
        method_table(
            "pooling_auroc",
            "Test AUROC of the pooling methods",
            metrics,
            grid,
            [
                ("attention", "all", False),
                ("gated_attention", "all", False),
                ("mean", "all", False),
                ("max", "all", False),
            ],
            "auroc",
            paper.POOLING_AUROC,
        ),
        p_sem_table(metrics, grid),
        throughput_table(
            "throughput",
            "Inference throughput (samples/s)",
            metrics,
            grid,
            ["hami", "hami_sp", "mean", "max"],
            paper.THROUGHPUT,
            others,
        ),
        throughput_table(
            "pooling_speed",
            "Inference throughput of the poolings (samples/s)",
            metrics,
            grid,
            ["attention", "gated_attention", "mean", "max"],
            paper.POOLING_SPEED,
        ),
        margin_table(metrics, grid),
        sd_table("sd_auroc", "Standard deviation of the test AUROC over seeds", metrics, grid, "auroc", paper.SD_AUROC),
        sd_table(
            "sd_margin",
            "Standard deviation of the test margin over seeds, after the last epoch (as the paper's margin table)",
            metrics,
            grid,
            "margin",
            paper.SD_MARGIN,
            last_epoch=True,
        ),
        margin_growth_table(metrics, grid),
        label_table(labels or {}, grid),
        *expected_tables(analysis or {}, grid),
        method_table(
            "detection_auroc",
            "Test AUROC of every detector and baseline, mean ± standard error over seeds [bootstrap 95% interval]",
            metrics,
            grid,
            blocks(everything, metrics),
            "auroc",
            {},
            with_ci=True,
        ),
        method_table(
            "detection_prr",
            "Test PRR (lm-polygraph's normalised prediction-rejection ratio, up to 100% "
            "rejected), mean ± standard error over seeds",
            metrics,
            grid,
            blocks(everything, metrics),
            "prr",
            {},
        ),
        _lower_is_better(
            method_table(
                "detection_fpr95",
                "Test FPR at 95% TPR (correct answers flagged when 95% of hallucinations are caught), "
                "mean ± standard error over seeds",
                metrics,
                grid,
                blocks(everything, metrics),
                "fpr_at_95_tpr",
                {},
            )
        ),
        length_table(metrics, grid, detectors),
        training_time_table(metrics, grid, detectors),
    ]
    return [t for t in tables if t is not None]


def _lower_is_better(table: Table | None) -> Table | None:
    if table is not None:
        table.higher_is_better = False
        rank(table)
    return table


def summary(metrics: dict, analysis: dict | None = None) -> dict:
    out = {}
    for (m, d, method), e in sorted(metrics.items()):
        t = e["test"]
        out[f"{m}/{d}/{method}"] = {
            "best_layer": e["best_layer"],
            "test_auroc": t["auroc"]["mean"],
            "test_auroc_ci95": t.get("auroc_ci95"),
            "test_prr": (t.get("prr") or {}).get("mean"),
            "test_fpr_at_95_tpr": (t.get("fpr_at_95_tpr") or {}).get("mean"),
            "test_margin": t["margin"]["mean"] if t["margin"] else None,
            "samples_per_s": e["throughput"]["preloaded_samples_per_s"] if "throughput" in e else None,
        }
    for (m, d, method), a in sorted((analysis or {}).items()):
        best = a["layers"][str(a["best_layer"])]
        out[f"{m}/{d}/{method}"]["analysis"] = {
            split: {
                "gamma": s["mean"]["c_int"]["gamma"],
                "inv_gamma": s["mean"]["c_int"]["inv_gamma"],
                "class_ratio": s["mean"]["c_int"]["class_ratio"],
                "condition_holds_seeds": s["mean"]["c_int"]["condition_holds_seeds"],
            }
            for split, s in best.items()
        }
    return out

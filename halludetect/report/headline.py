"""The headline figures: one small JSON per method and baseline of each grid cell, all in one shape,
the only files `dvc.yaml` declares as DVC metrics.

    <dir>/eval/<model>/<dataset>/<name>.json
        best_layer                 the layer chosen on validation (absent for a baseline)
        test.auroc.mean / .stderr  test AUROC, mean and standard error over seeds
        test.prr.mean              prediction-rejection ratio
        test.fpr_at_95_tpr.mean    false-positive rate at 95% true-positive rate
        gamma                      the analysis' gamma on test at the best layer (analysed methods only)

Why one shape: `dvc metrics show` prints one row per metrics file and one column per key found in
any of them, so files that share a few keys make a table of a few columns (the full metrics JSON
of one method has about a hundred keys, and the union of every file's made a 748 KB table). Why the
`eval/<model>/<dataset>/<method>.json` tail: `halludetect sweep` finds a method's figures in
`dvc exp show` by that tail and reads `best_layer` and `test.<metric>.mean`/`.stderr`, so a sweep
over these headlines tabulates AUROC, PRR and FPR@95. The full JSON stays where it was
(`metrics/eval/...`), a cached output that the report, export and figures
read."""

from __future__ import annotations

# The test metrics a headline carries: (key, with its standard error). Each adds a column (two with
# the error) to `dvc metrics show`; tests/report/test_headline.py holds the table to 200 columns.
TEST_METRICS = (("auroc", True), ("prr", False), ("fpr_at_95_tpr", False))


def headline(entry: dict, analysis: dict | None = None) -> dict:
    """The headline of one metrics JSON (a detector's evaluation or a baseline's), with the
    analysis' gamma on test at its best layer when the method was analysed."""
    test = entry["test"]
    out: dict = {}
    if entry.get("best_layer") is not None:
        out["best_layer"] = entry["best_layer"]
    figures = {}
    for key, with_error in TEST_METRICS:
        stat = test.get(key)
        if not stat or stat.get("mean") is None:
            continue
        figures[key] = {"mean": stat["mean"]}
        if with_error and stat.get("stderr") is not None:
            figures[key]["stderr"] = stat["stderr"]
    out["test"] = figures
    if analysis is not None:
        at_best = analysis["layers"][str(analysis["best_layer"])]
        if "test" in at_best:
            out["gamma"] = at_best["test"]["mean"]["c_int"]["gamma"]
    return out


def headlines(metrics: dict, analysis: dict | None = None) -> dict[str, dict]:
    """{relative path: headline} for every (model, dataset, name) of `metrics` (load_metrics'
    shape), the analysis (load_analysis' shape) joined to the method it analysed."""
    analysis = analysis or {}
    return {
        f"eval/{m}/{d}/{name}.json": headline(entry, analysis.get((m, d, name)))
        for (m, d, name), entry in sorted(metrics.items())
    }

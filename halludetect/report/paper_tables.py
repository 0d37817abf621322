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
margins by answer length. The table model and its Markdown/LaTeX rendering are in tables.py.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from halludetect.config import MODEL_BASELINES
from halludetect.evaluation.baselines import BASELINE_SCORES
from halludetect.methods import METHODS
from halludetect.report import paper
from halludetect.report.paper import Figure
from halludetect.report.tables import Cell, Row, Table, rank


# ----------------------------------------------------------------------- the grid's cells
@dataclass(frozen=True)
class Grid:
    """The grid's presets and the paper identity of each (None: not one of the paper's)."""

    models: list[str]
    datasets: list[str]
    model_keys: dict[str, str | None]
    dataset_keys: dict[str, str | None]

    @classmethod
    def of(cls, params) -> Grid:
        g = params.grid
        return cls(
            g.models,
            g.datasets,
            {m: paper.model_key(params.model(m).path) for m in g.models},
            {d: paper.dataset_key(params.dataset(d).loader) for d in g.datasets},
        )

    @property
    def cells(self) -> list[tuple[str, str]]:
        return [(m, d) for m in self.models for d in self.datasets]

    def groups(self) -> list[tuple[str, list[str]]]:
        return [(m, list(self.datasets)) for m in self.models]

    def paper_cell(self, m: str, d: str) -> tuple[str, str] | None:
        key = (self.model_keys.get(m), self.dataset_keys.get(d))
        return key if None not in key else None


def _published(figures: dict, grid: Grid, m: str, d: str) -> Figure | None:
    key = grid.paper_cell(m, d)
    return figures.get(key) if key else None


# Row names: a detector's is declared with its method (methods/), a baseline's with it
# (evaluation/baselines.py); a live view, so that a plugin registered after import is named too.
MODEL_BASELINE_NAMES = {"p_true": "p(True)"}
BASELINE_NAMES = {**{n: b.display for n, b in BASELINE_SCORES.items()}, **MODEL_BASELINE_NAMES}
assert set(MODEL_BASELINE_NAMES) == set(MODEL_BASELINES)


class _Names(Mapping):
    def _all(self) -> dict[str, str]:
        return {**{name: m.display for name, m in METHODS.items()}, **BASELINE_NAMES}

    def __getitem__(self, key: str) -> str:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


NAMES = _Names()


def family(method: str) -> str:
    """The report's block of a method or baseline: paper, field or yours (a plugin)."""
    if method in METHODS:
        return METHODS[method].family
    b = BASELINE_SCORES.get(method)
    return b.family if b is not None else "field"


def marked(method: str, metrics: dict) -> str:
    """A row name with what the method needs, from its metrics (cost_per_response) or its declaration."""
    needs = next(
        (e["cost_per_response"]["needs"] for k, e in metrics.items() if k[2] == method and e.get("cost_per_response")),
        None,
    )
    if needs is None:
        needs = METHODS[method].needs if method in METHODS else ()
    return f"{NAMES.get(method, method)} [{', '.join(needs) or 'the answer only'}]"


def per_response(seconds: float) -> str:
    """A cost per response as the tables print it: 12 µs, 3.4 ms, 1.2 s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs/resp."
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms/resp."
    return f"{seconds:.3g} s/resp."


def blocks(methods: list[str], metrics: dict, *, rule_first: bool = False) -> list[tuple[str, str | None, bool, str]]:
    """Rows (method, ranking group, rule before, label) of the methods present: the paper's, then
    the field's baselines, then the user's own detectors, each block after a rule; the last two
    marked with what they need."""
    out = []
    present = {k[2] for k in metrics}
    for fam in ("paper", "field", "yours"):
        mine = [m for m in methods if family(m) == fam and m in present]
        for i, m in enumerate(mine):
            label = NAMES.get(m, m) if fam == "paper" else marked(m, metrics)
            out.append((m, "all", i == 0 and (bool(out) or rule_first), label))
    return out


def cost_rows(metrics: dict, grid: Grid, methods: list[str]) -> list[Row]:
    """The throughput table's block of the field's baselines and plugins: responses per second with
    everything each needs (its cost per response, amortised), the cost itself in the note."""
    rows = []
    for method in methods:
        if family(method) == "paper" or not any((m, d, method) in metrics for m, d in grid.cells):
            continue
        cells = []
        for m, d in grid.cells:
            c = (metrics.get((m, d, method)) or {}).get("cost_per_response")
            cells.append(
                Cell(paper=None, fmt="rate")
                if c is None
                else Cell(c["samples_per_s"], note=per_response(c["seconds"]), fmt="rate")
            )
        rows.append(Row(marked(method, metrics), cells, not rows))
    return rows


def _stat_cell(
    entry: dict | None,
    key: str,
    published: Figure | None,
    *,
    with_ci=False,
    err="stderr",
    group="all",
    layer=True,
    cost=False,
) -> Cell:
    if entry is None:
        return Cell(paper=published, group=group)
    stat = entry["test"].get(key)
    if stat is None:  # e.g. a baseline's margin: its score is no logit
        return Cell(paper=published, group=None)
    ci = tuple(entry["test"]["auroc_ci95"]) if with_ci and entry["test"].get("auroc_ci95") else None
    note = f"L{entry['best_layer']}" if layer and entry.get("best_layer") is not None else ""
    if cost and entry.get("cost_per_response"):
        note = ", ".join(x for x in (note, per_response(entry["cost_per_response"]["seconds"])) if x)
    return Cell(stat["mean"], stat.get(err), ci, note, published, group=group)


def method_table(
    name: str,
    caption: str,
    metrics: dict,
    grid: Grid,
    rows: list[tuple],
    key: str,
    published: dict,
    *,
    with_ci=False,
    notes=(),
) -> Table | None:
    """Methods as rows (method, ranking group, rule before[, label]), grid cells as columns. A row
    with its own label (a block of the field's baselines or of plugins) shows each cell's cost
    per response beside the best layer."""
    present = [r for r in rows if any((m, d, r[0]) in metrics for m, d in grid.cells)]
    if not present:
        return None
    out = []
    for method, group, rule, *label in present:
        cells = [
            _stat_cell(
                metrics.get((m, d, method)),
                key,
                _published(published.get(method, {}), grid, m, d),
                with_ci=with_ci,
                group=group,
                cost=bool(label) and family(method) != "paper",
            )
            for m, d in grid.cells
        ]
        out.append(Row(label[0] if label else NAMES.get(method, method), cells, rule))
    return rank(Table(name, caption, "Method", grid.groups(), out, paper.PAPER_TABLES.get(name), list(notes)))


def sd_table(name: str, caption: str, metrics: dict, grid: Grid, key: str, published: dict) -> Table | None:
    rows = []
    for method in ("hami", "hami_sp", "mean", "max"):
        if not any((m, d, method) in metrics for m, d in grid.cells):
            continue
        cells = []
        for m, d in grid.cells:
            stat = (metrics.get((m, d, method)) or {}).get("test", {}).get(key)
            cells.append(
                Cell(
                    None if stat is None else stat.get("sd"),
                    paper=_published(published.get(method, {}), grid, m, d),
                    group=None,
                )
            )
        rows.append(Row(NAMES[method], cells, method == "mean"))
    if not rows:
        return None
    return Table(
        name,
        caption,
        "Method",
        grid.groups(),
        rows,
        paper.PAPER_TABLES[name],
        [
            "standard deviation of one seed's figure over the seeds (the paper's appendix; its main "
            "tables' captions call them standard errors)"
        ],
    )


def throughput_table(
    name: str, caption: str, metrics: dict, grid: Grid, methods: list[str], published: dict, others: list[str] = ()
) -> Table | None:
    rows = []
    for method in methods:
        if not any((m, d, method) in metrics for m, d in grid.cells):
            continue
        variants = (
            [("", None)]
            if method != "hami_sp"
            else [
                (" with sampling and NLI, amortised", "samples_per_s_with_sampling_and_nli"),
                (" with sampling and NLI, sequential", "sequential_samples_per_s"),
            ]
        )
        for suffix, cost_key in variants:
            cells = []
            for m, d in grid.cells:
                e = metrics.get((m, d, method))
                pub = _published(published.get(method, {}), grid, m, d)
                if method == "hami_sp" and cost_key != "sequential_samples_per_s":
                    pub = None  # the paper's HaMI (SP) figure is a one-response-at-a-time cost
                if e is None:
                    cells.append(Cell(paper=pub, fmt="rate"))
                    continue
                t = e["throughput"]
                value = t["preloaded_samples_per_s"] if cost_key is None else e.get("cost", {}).get(cost_key)
                note = t.get("device", "")
                cells.append(Cell(value, note=note, paper=pub, fmt="rate"))
            rows.append(Row(NAMES[method] + suffix, cells, method in ("mean", "attention")))
    if others and (more := cost_rows(metrics, grid, list(others))):
        rows += more
    if not rows:
        return None
    notes = [
        "samples/s of detector inference on the best layer's test responses (preloaded tensors); the "
        "paper's figures are one A100's. HaMI (SP) adds K - 1 more samples and the NLI calls per response: "
        "amortised over batched rounds, or paid one response at a time (sequential)",
        *(
            [
                "the field's baselines and your detectors: responses/s with all each needs [in brackets], "
                "amortised: its own scoring plus the K - 1 more samples, NLI calls or forward pass it needs"
            ]
            if others
            else []
        ),
    ]
    return rank(Table(name, caption, "Method", grid.groups(), rows, paper.PAPER_TABLES.get(name), notes))


def p_sem_table(metrics: dict, grid: Grid) -> Table | None:
    """The paper's layout: datasets as rows, models as columns."""
    if not any((m, d, "p_sem") in metrics for m, d in grid.cells):
        return None
    rows = []
    for d in grid.datasets:
        cells = [
            _stat_cell(
                metrics.get((m, d, "p_sem")),
                "auroc",
                _published(paper.P_SEM_AUROC, grid, m, d),
                with_ci=True,
                group=None,
                layer=False,
            )
            for m in grid.models
        ]
        rows.append(Row(d, cells))
    return Table(
        "p_sem_auroc",
        "Test AUROC of the semantic probability as a discriminator (1 - P_sem)",
        "Dataset",
        [("", list(grid.models))],
        rows,
        paper.PAPER_TABLES["p_sem_auroc"],
        ["[bootstrap 95% interval]"],
    )


def label_table(labels: dict, grid: Grid) -> Table | None:
    """Positives (hallucinated), negatives (correct) and |S_neg| / |S_pos| per cell and split."""
    rows = []
    for m, d in grid.cells:
        found = labels.get((m, d))
        if not found:
            continue
        key = grid.paper_cell(m, d)
        for split in ("train", "test"):
            s = found["splits"].get(split)
            if s is None:
                continue
            pub = paper.LABELS.get(key, {}).get(split) if key else None
            pos, neg = s["hallucinated"], s["correct"]
            rows.append(
                Row(
                    f"{m} / {d} / {split}",
                    [
                        Cell(pos, fmt="int", paper=pub[0] if pub else None, group=None),
                        Cell(neg, fmt="int", paper=pub[1] if pub else None, group=None),
                        Cell(neg / pos if pos else None, fmt=".2f", paper=pub[2] if pub else None, group=None),
                    ],
                    split == "train" and bool(rows),
                )
            )
    if not rows:
        return None
    return Table(
        "label_distribution",
        "Number of positive (hallucinated) and negative (correct) responses and the class ratio |S_neg| / |S_pos|",
        "Model / dataset / split",
        [("", ["Pos.", "Neg.", "Ratio (neg/pos)"])],
        rows,
        paper.PAPER_TABLES["label_distribution"],
        ["kept responses after the two-pass judge (metrics/labels)"],
    )


EXPECTED_COLUMNS = [
    ("Semantic prob. E[P_sem]", ["Pos", "Neg"]),
    ("Sensitivity E[C]", ["Pos", "Neg"]),
    ("Joint product E[P_sem C]", ["Pos", "Neg"]),
    ("Ratios", ["γ", "1/γ"]),
    ("Condition", ["|S_neg|/|S_pos|", "holds"]),
]


def expected_tables(analysis: dict, grid: Grid) -> list[Table]:
    """One table per (sensitivity variant, model, split), as the paper's appendix: datasets (and
    analysed methods) as rows, class-wise expectations at the best layer, mean over seeds."""
    tables = []
    methods = sorted({k[2] for k in analysis}, key=lambda x: (x != "hami_sp", x))
    for variant, what in (("c_int", "path-integrated C_B^int"), ("c0", "C_B at p = 0")):
        for m in grid.models:
            for split in ("train", "test"):
                rows = []
                for d in grid.datasets:
                    for method in methods:
                        a = analysis.get((m, d, method))
                        s = a and a["layers"][str(a["best_layer"])].get(split)
                        if not s:
                            continue
                        rows.append(
                            _expected_row(
                                s["mean"][variant],
                                d if method == "hami_sp" else f"{d} ({NAMES[method]}, λ = {a['lam']:g})",
                                _paper_expected(variant, grid, m, d, split, method),
                            )
                        )
                if rows:
                    tables.append(
                        Table(
                            f"expected_{variant}_{m}_{split}",
                            f"Empirical expected values for {m} ({split}), sensitivity {what}, at the best layer, mean "
                            "over seeds",
                            "Dataset",
                            EXPECTED_COLUMNS,
                            rows,
                            _paper_expected_label(variant, grid.model_keys.get(m), split),
                            [
                                "pos = hallucinated, neg = correct; gamma = E_neg[P_sem C] / E_pos[P_sem C] of the "
                                "expectations shown; the scaling widens the margin when |S_neg|/|S_pos| > 1/gamma, "
                                "a form that applies where both E[P_sem C] > 0 ('holds': seeds where it does / seeds "
                                "where it applies)"
                            ],
                        )
                    )
    return tables


def _paper_expected(variant, grid: Grid, m, d, split, method):
    key = grid.paper_cell(m, d)
    if method != "hami_sp" or key is None:
        return None
    return paper.EXPECTED.get((variant, key[0], split), {}).get(key[1])


def _paper_expected_label(variant, model_key, split):
    short = {"llama3.1-8b": "llama8b", "mistral-nemo-12b": "mistral12b", "llama3.3-70b": "llama70b"}.get(model_key)
    if short is None:
        return None
    suffix = "_non_invariant" if variant == "c_int" else ""
    return f"tab:exp_{short}_{'train' if split == 'train' else 'val'}{suffix}"  # the paper's test tables: _val


def _expected_row(e: dict, label: str, pub) -> Row:
    def c(value, fig=None, fmt="sig3"):
        return Cell(value, paper=fig, fmt=fmt, group=None)

    holds, applies = e["condition_holds_seeds"]
    verdict = f"{holds}/{applies} seeds" if applies else "n/a: E[P_sem C] <= 0"
    return Row(
        label,
        [
            c(e["pos"]["p_sem"], pub and pub.p_sem_pos, ".3f"),
            c(e["neg"]["p_sem"], pub and pub.p_sem_neg, ".3f"),
            c(e["pos"]["c"], pub and pub.c_pos),
            c(e["neg"]["c"], pub and pub.c_neg),
            c(e["pos"]["p_sem_c"], pub and pub.p_sem_c_pos),
            c(e["neg"]["p_sem_c"], pub and pub.p_sem_c_neg),
            c(e["gamma"], pub and pub.gamma, ".2f"),
            c(e["inv_gamma"], pub and pub.inv_gamma, ".2f"),
            c(e["class_ratio"], None, ".2f"),
            Cell(text=verdict, group=None),
        ],
    )


def length_table(metrics: dict, grid: Grid, methods: list[str]) -> Table | None:
    rows = []
    for method in methods:
        for bucket in ("<=5", "6-30", ">30"):
            cells, seen = [], False
            for m, d in grid.cells:
                b = ((metrics.get((m, d, method)) or {}).get("test", {}).get("margin_by_length") or {}).get(bucket)
                seen |= b is not None
                if b is None or b["margin"] is None:
                    cells.append(Cell(group=None))
                else:
                    cells.append(Cell(b["margin"]["mean"], b["margin"]["stderr"], note=f"n={b['n']}", group=None))
            if seen:
                rows.append(Row(f"{NAMES.get(method, method)}, {bucket} tokens", cells, bucket == "<=5" and bool(rows)))
    if not rows:
        return None
    return Table(
        "margin_by_length",
        "Test margin mean(y z) by answer length",
        "Method, length",
        grid.groups(),
        rows,
        None,
        ["answer tokens (the bag length); mean ± standard error over seeds; n = responses in the bucket"],
    )


def sweep_table(
    param: str,
    results: dict[tuple[str, str], dict],
    grid: Grid,
    metric: str = "auroc",
    name: str | None = None,
    marks: dict | None = None,
) -> Table:
    """A sweep of one parameter (e.g. `detectors.max.dim`): {(model, dataset): {value: metrics JSON}}.
    Rows are the swept values, columns the grid cells; for the max-pooling D sweep the paper's
    figures (tab:dim_max_*) stand beside ours. `marks` ({value: "failed", ...}): values with no
    results, shown as rows with the mark in every cell rather than left out."""
    marks = marks or {}
    values = sorted(
        {v for per_cell in results.values() for v in per_cell} | set(marks), key=lambda v: (str(type(v)), v)
    )
    rows = []
    for v in values:
        cells = []
        for m, d in grid.cells:
            e = results.get((m, d), {}).get(v)
            pub = None
            key = grid.paper_cell(m, d)
            if param == "detectors.max.dim" and key:
                pub = paper.DIM_SWEEP.get(key[0], {}).get(v, {}).get(key[1])
            if e:
                cells.append(_stat_cell(e, metric, pub, group="all"))
            else:
                cells.append(Cell(paper=pub, text=marks.get(v), group=None if v in marks else "all"))
        rows.append(Row(str(v), cells))
    label = None
    if param == "detectors.max.dim":
        label = "tab:dim_max_llama8b, tab:dim_max_mistral12b, tab:dim_max_llama70b"
    return rank(
        Table(
            name or f"sweep_{param.replace('.', '_')}",
            f"Test {metric.upper()} by {param}",
            param,
            grid.groups(),
            rows,
            label,
            ["mean ± standard error over seeds, best layer on validation"],
        )
    )


# -------------------------------------------------------------------- loading, building
def load_metrics(
    directory: str | Path,
    models: list[str],
    datasets: list[str],
    methods: list[str],
    baselines_dir: str | Path | None = None,
    baselines: list[str] = (),
    model_baselines: list[str] = (),
) -> dict:
    """Metrics of exactly the grid's cells: a missing file is an error, a stale one is ignored.
    Baselines: `<baselines_dir>/<m>/<d>.json` (stage baselines), and those that run the model,
    `<baselines_dir>/<m>/<d>/<name>.json` (stage model_baselines)."""
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
            for name in model_baselines:
                path = Path(baselines_dir) / m / d / f"{name}.json"
                if path.exists():
                    out[(m, d, name)] = json.loads(path.read_text())
                else:
                    missing.append(str(path))
    if missing:
        raise FileNotFoundError(
            f"metrics missing for {len(missing)} grid cell(s): {missing[:5]}; run evaluate and baselines first"
        )
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
        method_table(
            "margin",
            "Test margin mean(y z) in logit space, mean ± standard error over seeds",
            metrics,
            grid,
            four,
            "margin",
            paper.MARGIN,
            notes=[
                "ranked within each family: instance-based (HaMI) and embedding-based logits are on different scales"
            ],
        ),
        sd_table("sd_auroc", "Standard deviation of the test AUROC over seeds", metrics, grid, "auroc", paper.SD_AUROC),
        sd_table(
            "sd_margin", "Standard deviation of the test margin over seeds", metrics, grid, "margin", paper.SD_MARGIN
        ),
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

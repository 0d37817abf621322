"""What every table of the report shares: the grid's cells (`Grid`) and the paper's figure of a
cell, each method's display name and family, the blocks the methods stand in (the paper's, the
field's baselines, plugins) with what each needs, a cell with its statistic and run count, and the
conventions a caption states (how many seeds, which P_sem variant)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from halludetect.methods import METHODS, SCORES, SP_METHODS
from halludetect.report import paper
from halludetect.report.paper import Figure
from halludetect.report.tables import Cell, Row


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


def paper_figure(figures: dict, grid: Grid, m: str, d: str) -> Figure | None:
    key = grid.paper_cell(m, d)
    return figures.get(key) if key else None


# Row names: each declared with its detector (methods/: a method on hidden states, or a score with
# nothing to train); a live view, so that a plugin registered after import is named too.
BASELINE_NAMES = {n: s.display for n, s in SCORES.items()}


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
    s = SCORES.get(method)
    return s.family if s is not None else "field"


def marked(method: str, metrics: dict) -> str:
    """A row name with what the method needs, from its metrics (cost_per_response) or its declaration."""
    needs = next(
        (e["cost_per_response"]["needs"] for k, e in metrics.items() if k[2] == method and e.get("cost_per_response")),
        None,
    )
    if needs is None:
        declared = METHODS.get(method) or SCORES.get(method)
        needs = declared.needs if declared is not None else ()
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


# ------------------------------------------------------------------ conventions in captions
# Every AUROC and margin table of the paper averages five runs (its captions say so).
PAPER_RUNS = 5


# How each P_sem variant of clusters.parquet weighs an answer (a short name, and what it is).
P_SEM_VARIANTS = {
    "sum": (
        "summed",
        "each answer weighs its likelihood P(A|q), the product of its token probabilities: the paper's formula",
    ),
    "mean": ("length-normalised", "each answer weighs exp(mean token log-probability): not the paper's formula"),
    "count": ("count", "a cluster's share of the K answers (the HaMI code's): not the paper's formula"),
}


def n_seeds(entry: dict | None) -> int | None:
    """How many seeds are behind an entry's figures (None: a baseline, or no record)."""
    seeds = (entry or {}).get("seeds")
    return len(seeds) if seeds else None


def seeds_phrase(entries: list[dict]) -> tuple[str, bool]:
    """The caption's count of seeds behind the cells, and whether it differs between cells (then
    each cell names its own)."""
    counts = sorted({n for e in entries if (n := n_seeds(e))})
    if not counts:
        return "", False
    if len(counts) == 1:
        return f"ours over {counts[0]} seed{'s' if counts[0] != 1 else ''} per cell", False
    return f"ours over {counts[0]} to {counts[-1]} seeds (each cell's count in its note)", True


def runs_beside(published: Figure | None, entry: dict | None) -> Figure | None:
    """The paper's figure, saying it averages five runs where ours averages another count."""
    n = n_seeds(entry)
    if published is None or n is None or n == PAPER_RUNS:
        return published
    return Figure(published.value, f"{published.text}, {PAPER_RUNS} runs")


def p_sem_label(variant: str) -> str:
    return f"P_sem {P_SEM_VARIANTS.get(variant, (variant,))[0]}"


def p_sem_phrase(entries: list[dict]) -> tuple[str, list[str]]:
    """The P_sem convention of the entries that use it, for a caption (short) and its notes
    (what each variant is): HaMI (SP)'s scaling and the P_sem baseline."""
    sp = sorted(
        {
            (e["params"]["p_sem"], e["params"]["lam"])
            for e in entries
            if e.get("method") in SP_METHODS and e.get("params")
        }
    )
    base = sorted({e["params"]["variant"] for e in entries if e.get("method") == "p_sem" and e.get("params")})
    parts = []
    if sp:
        parts.append(
            "HaMI (SP) scales by (1 + λ P_sem), " + "; ".join(f"λ = {lam:g}, {p_sem_label(v)}" for v, lam in sp)
        )
    if base:
        parts.append("the P_sem baseline is 1 - " + ", ".join(p_sem_label(v) for v in base))
    variants = sorted({v for v, _ in sp} | set(base))
    notes = [f"{p_sem_label(v)}: {P_SEM_VARIANTS[v][1]}" for v in variants if v in P_SEM_VARIANTS]
    return "; ".join(parts), notes


def conventions(caption: str, entries: list[dict], notes=()) -> tuple[str, list[str], bool]:
    """A caption with the seeds and the P_sem convention behind its cells, and the notes that
    define the variants; plus whether the cells must name their own seed count."""
    seeds, per_cell = seeds_phrase(entries)
    p_sem, defs = p_sem_phrase(entries)
    extra = "; ".join(x for x in (seeds, p_sem) if x)
    return (f"{caption} ({extra})" if extra else caption), [*notes, *defs], per_cell


def stat_cell(
    entry: dict | None,
    key: str,
    published: Figure | None,
    *,
    with_ci=False,
    err="stderr",
    group="all",
    layer=True,
    cost=False,
    seeds_note=False,
    stat: dict | None = None,
) -> Cell:
    published = runs_beside(published, entry)
    if entry is None:
        return Cell(paper=published, group=group)
    stat = entry["test"].get(key) if stat is None else stat
    if stat is None:  # e.g. a baseline's margin: its score is no logit
        return Cell(paper=published, group=None)
    ci = tuple(entry["test"]["auroc_ci95"]) if with_ci and entry["test"].get("auroc_ci95") else None
    note = f"L{entry['best_layer']}" if layer and entry.get("best_layer") is not None else ""
    if cost and entry.get("cost_per_response"):
        note = ", ".join(x for x in (note, per_response(entry["cost_per_response"]["seconds"])) if x)
    if seeds_note and n_seeds(entry):
        note = f"{note} {n_seeds(entry)} seeds".strip()
    return Cell(stat["mean"], stat.get(err), ci, note, published, group=group)


def test_stat(entry: dict | None, key: str, last_epoch: bool = False) -> dict | None:
    """A test statistic of an entry: at the best validation epoch, or after the last epoch (the
    weights the paper reads its margins from); None where the entry has no such figure."""
    if entry is None:
        return None
    if last_epoch:
        return ((entry.get("last_epoch") or {}).get("test") or {}).get(key)
    return entry.get("test", {}).get(key)

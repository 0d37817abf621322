"""The analysis tables of HaMI (SP): E[P_sem], E[C], E[P_sem C], gamma, 1/gamma and the margin
condition per model, dataset and split (the paper's tab:exp_*), from the analyze stage's output."""

from __future__ import annotations

from halludetect.report import paper
from halludetect.report.cells import NAMES, P_SEM_VARIANTS, Grid, p_sem_label
from halludetect.report.tables import Cell, Row, Table

EXPECTED_COLUMNS = [
    ("Semantic prob. E[P_sem]", ["Pos", "Neg"]),
    ("Sensitivity E[C]", ["Pos", "Neg"]),
    ("Joint product E[P_sem C]", ["Pos", "Neg"]),
    ("Ratios", ["γ", "1/γ"]),
    ("Condition", ["|S_neg|/|S_pos|", "holds"]),
    ("Margin mean(y Z)", ["widens", "change", "predicted"]),
]  # the tolerance of the path identity is analyze.path_tolerance (the analysis JSON's path_check)


TOP_K_SHORT = {"c_int": "top-k re-ranked along the path", "c0": "top-k of the unscaled logits"}


TOP_K = {
    "c_int": "C_B^int averages the slope along the path, its top-k set re-ranked at every step from the "
    "unscaled (p = 0) to the scaled logits (p = p_B)",
    "c0": "C_B is the slope at p = 0, its top-k set that of the unscaled logits",
}


def expected_tables(analysis: dict, grid: Grid) -> list[Table]:
    """One table per (sensitivity variant, model, split), as the paper's appendix: datasets (and
    analysed methods) as rows, class-wise expectations at the best layer, mean over seeds, the
    margin's change (measured, and predicted from C), and the paper's range over its cells."""
    tables = []
    methods = sorted({k[2] for k in analysis}, key=lambda x: (x != "hami_sp", x))
    for variant, what in (("c_int", "path-integrated C_B^int"), ("c0", "C_B at p = 0")):
        for m in grid.models:
            for split in ("train", "test"):
                rows, used, blank, missed = [], [], False, []
                for d in grid.datasets:
                    for method in methods:
                        a = analysis.get((m, d, method))
                        s = a and a["layers"][str(a["best_layer"])].get(split)
                        if not s:
                            continue
                        used.append(a)
                        e = s["mean"][variant]
                        blank |= not e.get("condition_applies", True)
                        check = s.get("path_check")
                        if variant == "c_int" and check and not check["within_tolerance"]:
                            missed.append(f"{d} ({NAMES[method]}): {check['max_abs_identity_gap']:.3g}")
                        who = "" if method == "hami_sp" else f", {NAMES[method]} under λ = {a['lam']:g}"
                        rows.append(
                            _expected_row(
                                e,
                                s.get("margin"),
                                variant,
                                f"{d} (layer {a['best_layer']}{who})",
                                _paper_expected(variant, grid, m, d, split, method),
                            )
                        )
                if not rows:
                    continue
                rows.append(_paper_range_row(variant))
                tables.append(
                    Table(
                        f"expected_{variant}_{m}_{split}",
                        f"Empirical expected values for {m} ({split}), sensitivity {what} ({TOP_K_SHORT[variant]}), "
                        f"at each detector's best layer on validation (in the row), mean over seeds "
                        f"({_analysis_conventions(used)})",
                        "Dataset",
                        EXPECTED_COLUMNS,
                        rows,
                        _paper_expected_label(variant, grid.model_keys.get(m), split),
                        _expected_notes(variant, used, blank, missed),
                    )
                )
    return tables


def _analysis_conventions(used: list[dict]) -> str:
    seeds = sorted({len(a["seeds"]) for a in used if a.get("seeds")})
    scalings = sorted({(a["lam"], a.get("p_sem", "?")) for a in used})
    parts = [f"λ = {lam:g}, {p_sem_label(v)}" for lam, v in scalings]
    if seeds:
        parts.append(f"{'/'.join(map(str, seeds))} seeds")
    return "; ".join(parts)


def _expected_notes(variant: str, used: list[dict], blank: bool, missed: list[str]) -> list[str]:
    notes = [
        "pos = hallucinated, neg = correct; gamma = E_neg[P_sem C] / E_pos[P_sem C] of the expectations shown; "
        "the scaling widens the margin when |S_neg| E_neg[P_sem C] > |S_pos| E_pos[P_sem C] ('widens': seeds "
        "where it does), which the paper writes |S_neg|/|S_pos| > 1/gamma ('holds': seeds where that form holds / "
        "seeds where it applies)",
        f"{TOP_K[variant]}",
        "margin 'change': the margin mean(y Z) with the scaling minus without, measured from the logits; "
        f"'predicted': from {'C_B^int (exact up to the N steps)' if variant == 'c_int' else 'C_B (first order)'}",
        "the paper's row: the range of each figure over its 24 cells (3 models x 4 datasets x train and test); its "
        f"text quotes 1/γ from {paper.INV_GAMMA_QUOTED[variant][0]} to {paper.INV_GAMMA_QUOTED[variant][1]}",
    ]
    if blank:
        notes.append(
            "γ and 1/γ blank where E[P_sem C] <= 0 in a class: dividing by it flips the inequality, so the "
            "ratio form does not apply ('widens' still does)"
        )
    if missed:
        notes.append(
            "WARNING: the path identity Z(p_B) = Z(0) - p_B C_B^int misses by more than analyze.path_tolerance "
            "on some bags (largest gap in logits): " + "; ".join(missed) + "; raise analyze.steps"
        )
    defs = {a.get("p_sem") for a in used}
    notes += [f"{p_sem_label(v)}: {P_SEM_VARIANTS[v][1]}" for v in sorted(defs) if v in P_SEM_VARIANTS]
    return notes


def _paper_range_row(variant: str) -> Row:
    """The paper's figures of this sensitivity as ranges over all its cells (every model, dataset, split)."""
    cells = [x for (v, _, _), rows in paper.EXPECTED.items() if v == variant for x in rows.values()]
    fields = ["p_sem_pos", "p_sem_neg", "c_pos", "c_neg", "p_sem_c_pos", "p_sem_c_neg", "gamma", "inv_gamma"]

    def span(name):
        figs = sorted((getattr(c, name) for c in cells), key=lambda f: f.value)
        return Cell(text=f"{figs[0].text}–{figs[-1].text}", group=None)

    ratio = sorted((r[2] for splits in paper.LABELS.values() for r in splits.values()), key=lambda f: f.value)
    return Row(
        "the paper (range over its cells)",
        [*(span(f) for f in fields), Cell(text=f"{ratio[0].text}–{ratio[-1].text}", group=None)]
        + [Cell(text="all", group=None), Cell(group=None), Cell(group=None), Cell(group=None)],
        True,
    )


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


def _expected_row(e: dict, margin: dict | None, variant: str, label: str, pub) -> Row:
    def c(value, fig=None, fmt="sig3"):
        return Cell(value, paper=fig, fmt=fmt, group=None)

    applies = e.get("condition_applies", e.get("gamma") is not None)
    holds, n_applies = e["condition_holds_seeds"]
    verdict = f"{holds}/{n_applies} seeds" if n_applies else "n/a: E[P_sem C] <= 0"
    widens = e.get("margin_widens_seeds")
    margin = margin or {}
    predicted = margin.get("change_from_c_int" if variant == "c_int" else "change_from_c0")
    return Row(
        label,
        [
            c(e["pos"]["p_sem"], pub and pub.p_sem_pos, ".3f"),
            c(e["neg"]["p_sem"], pub and pub.p_sem_neg, ".3f"),
            c(e["pos"]["c"], pub and pub.c_pos),
            c(e["neg"]["c"], pub and pub.c_neg),
            c(e["pos"]["p_sem_c"], pub and pub.p_sem_c_pos),
            c(e["neg"]["p_sem_c"], pub and pub.p_sem_c_neg),
            # blank where the ratio form does not apply: its reason is in the table's notes
            c(e["gamma"] if applies else None, pub and pub.gamma, ".2f"),
            c(e["inv_gamma"] if applies else None, pub and pub.inv_gamma, ".2f"),
            c(e["class_ratio"], None, ".2f"),
            Cell(text=verdict, group=None),
            Cell(text=f"{widens[0]}/{widens[1]} seeds" if widens else None, group=None),
            c(margin.get("change")),
            c(predicted),
        ],
    )

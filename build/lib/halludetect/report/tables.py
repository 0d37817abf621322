"""Tables as data, rendered to Markdown and LaTeX: cells with our figure (± error, interval, note)
and the paper's beside it, best and second-best marks, and escaping for both formats.

A `Table` has a caption, a first-column heading, column groups (the paper's multi-column headers:
a model, then its datasets) and rows; `rank` marks the best value of each column in bold and the
second underlined, compared at the printed precision so that equal printed figures share a mark.
`to_latex` writes a booktabs table with caption and label, every special character escaped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from halludetect.report.paper import Figure

# ------------------------------------------------------------------------ LaTeX escaping
_LATEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
    "±": r"$\pm$",
    "×": r"$\times$",
    "≤": r"$\leq$",
    "≥": r"$\geq$",
    "γ": r"$\gamma$",
    "λ": r"$\lambda$",
    "–": "--",
    "—": "---",
    "…": r"\ldots{}",
    "→": r"$\rightarrow$",
    "\n": " ",
}


def latex_escape(text: str) -> str:
    """Plain text -> LaTeX that prints it: every special character, in one pass (so nothing
    a replacement inserts is escaped again)."""
    return "".join(_LATEX.get(ch, ch) for ch in str(text))


# ------------------------------------------------------------------------------- tables
@dataclass
class Cell:
    """Our figure (value; optional ± err, 95% interval, note such as the best layer) and the
    paper's figure for the same cell, if it published one."""

    value: float | None = None
    err: float | None = None
    ci: tuple[float, float] | None = None
    note: str = ""
    paper: Figure | None = None
    fmt: str = ".3f"
    group: str | None = "all"  # cells of one column ranked together; None: not ranked
    mark: str = ""  # "best" | "second", set by rank()
    text: str | None = None  # shown instead of a number (e.g. "3/3 seeds")

    def ours(self) -> str:
        if self.text is not None:
            return self.text
        return "-" if self.value is None else number(self.value, self.fmt)


@dataclass
class Row:
    label: str
    cells: list[Cell]
    rule_before: bool = False  # a rule above this row (the paper's grouping)


@dataclass
class Table:
    name: str  # file stem
    caption: str
    header: str  # the first column's heading
    groups: list[tuple[str, list[str]]]  # column groups: (heading, column headings)
    rows: list[Row]
    paper_label: str | None = None
    notes: list[str] = field(default_factory=list)
    higher_is_better: bool = True

    @property
    def label(self) -> str:
        return f"tab:ours_{self.name}"


def number(v: float, fmt: str) -> str:
    if fmt == "sig3":  # 3 significant digits, trailing zeros kept as the paper prints them (6.59, 13.2, 0.430)
        return format(v, "#.3g").rstrip(".")
    if fmt == "rate":  # samples/s: thousands as integers, small rates with 3 significant digits
        return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
    if fmt == "int":
        return f"{int(round(v)):,}"
    return format(v, fmt)


def rank(table: Table) -> Table:
    """Mark the best and second-best value of every column (per ranking group), compared at the
    precision shown, so that equal printed figures share a mark."""
    for j in range(sum(len(cols) for _, cols in table.groups)):
        cells = [r.cells[j] for r in table.rows if j < len(r.cells)]
        for group in {c.group for c in cells if c.group is not None}:
            ranked = [c for c in cells if c.group == group and c.value is not None]
            shown = sorted({float(c.ours().replace(",", "")) for c in ranked}, reverse=table.higher_is_better)
            for c in ranked:
                v = float(c.ours().replace(",", ""))
                c.mark = "best" if v == shown[0] else "second" if len(shown) > 1 and v == shown[1] else ""
    return table


def _cell_md(c: Cell) -> str:
    text = c.ours()
    if c.mark == "best":
        text = f"**{text}**"
    elif c.mark == "second":
        text = f"<u>{text}</u>"
    if c.err is not None:
        text += f" ± {number(c.err, c.fmt)}"
    if c.ci is not None:
        text += f" [{number(c.ci[0], c.fmt)}, {number(c.ci[1], c.fmt)}]"
    if c.note:
        text += f" {c.note}"
    if c.paper is not None:
        text += f" ({c.paper.text})"
    return text


def _cell_tex(c: Cell) -> str:
    text = latex_escape(c.ours())
    if c.mark == "best":
        text = rf"\textbf{{{text}}}"
    elif c.mark == "second":
        text = rf"\underline{{{text}}}"
    if c.err is not None:
        text += rf"$\pm${latex_escape(number(c.err, c.fmt))}"
    if c.ci is not None:
        text += rf" {{\scriptsize[{latex_escape(number(c.ci[0], c.fmt))}, {latex_escape(number(c.ci[1], c.fmt))}]}}"
    if c.note:
        text += rf" {{\scriptsize {latex_escape(c.note)}}}"
    if c.paper is not None:
        text += f" ({latex_escape(c.paper.text)})"
    return text


def legend(table: Table) -> str:
    ranked = any(c.group is not None and c.value is not None for r in table.rows for c in r.cells)
    paper_side = table.paper_label is not None or any(c.paper is not None for r in table.rows for c in r.cells)
    return ("ours; the paper's published figure in parentheses where it has the cell" if paper_side else "ours") + (
        "; best in bold, second underlined" if ranked else ""
    )


def md_escape(text: str) -> str:
    """A pipe ends a Markdown table cell: escape it (|S_neg| / |S_pos| stays one cell)."""
    return str(text).replace("|", r"\|")


def to_markdown(table: Table) -> str:
    single = len(table.groups) == 1 and not table.groups[0][0]
    heads = [c if single or not g else f"{g} / {c}" for g, cols in table.groups for c in cols]
    lines = [
        f"**{md_escape(table.caption)}** ({legend(table)})",
        "",
        "| " + " | ".join(md_escape(h) for h in [table.header, *heads]) + " |",
        "|" + "---|" * (len(heads) + 1),
    ]
    for row in table.rows:
        lines.append("| " + " | ".join([md_escape(row.label), *(md_escape(_cell_md(c)) for c in row.cells)]) + " |")
    cf = [f"The paper's table: `{table.paper_label}`."] if table.paper_label else []
    notes = [*table.notes, *cf]
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else [])) + "\n"


def to_latex(table: Table) -> str:
    n_cols = sum(len(cols) for _, cols in table.groups)
    spec = "l" + " ".join("c" * len(cols) for _, cols in table.groups)
    lines = [
        r"% generated by halludetect (metrics/tables); needs \usepackage{booktabs,graphicx}",
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        rf"\caption{{{latex_escape(table.caption)}. {latex_escape(legend(table).capitalize())}."
        + "".join(f" {latex_escape(n)}" for n in table.notes)
        + "}",
        rf"\label{{{table.label}}}",
    ]
    wide = n_cols > 4
    if wide:
        lines.append(r"\resizebox{\textwidth}{!}{%")
    lines += [rf"\begin{{tabular}}{{{spec}}}", r"\toprule"]
    if any(g for g, _ in table.groups):
        heads, rules, col = [""], [], 2
        for g, cols in table.groups:
            heads.append(rf"\multicolumn{{{len(cols)}}}{{c}}{{{latex_escape(g)}}}")
            rules.append(rf"\cmidrule(lr){{{col}-{col + len(cols) - 1}}}")
            col += len(cols)
        lines += [" & ".join(heads) + r" \\", " ".join(rules)]
    lines.append(
        " & ".join([latex_escape(table.header), *(latex_escape(c) for _, cols in table.groups for c in cols)]) + r" \\"
    )
    lines.append(r"\midrule")
    for row in table.rows:
        if row.rule_before:
            lines.append(r"\midrule")
        lines.append(" & ".join([latex_escape(row.label), *(_cell_tex(c) for c in row.cells)]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if wide:
        lines.append("}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"

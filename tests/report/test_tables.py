"""Tables as data (halludetect/report/tables.py): LaTeX escaping of every special character in one pass,
and best and second-best marks ranked at the printed precision."""

from halludetect.report.tables import Cell, Row, Table, latex_escape, rank


def test_latex_escaping_covers_every_special_character():
    assert latex_escape(r"a_b & 50% $x$ #1 {y} ~z ^w \n <a> |b| ± × ≤ ≥ γ λ – — …") == (
        r"a\_b \& 50\% \$x\$ \#1 \{y\} \textasciitilde{}z \textasciicircum{}w \textbackslash{}n "
        r"\textless{}a\textgreater{} \textbar{}b\textbar{} $\pm$ $\times$ $\leq$ $\geq$ $\gamma$ $\lambda$ -- --- "
        r"\ldots{}"
    )
    assert latex_escape("\\_") == r"\textbackslash{}\_"  # one pass: what a replacement inserts is not re-escaped


def test_best_and_second_are_ranked_at_the_printed_precision():
    t = Table(
        "t",
        "c",
        "Method",
        [("g", ["a", "b"])],
        [
            Row("x", [Cell(0.9001), Cell(1.0, group=None)]),
            Row("y", [Cell(0.9004), Cell(2.0)]),
            Row("z", [Cell(0.8), Cell(None)]),
            Row("w", [Cell(0.7), Cell(1.5)]),
        ],
    )
    rank(t)
    assert [r.cells[0].mark for r in t.rows] == ["best", "best", "second", ""]  # 0.900 twice: a tie
    assert [r.cells[1].mark for r in t.rows] == ["", "best", "", "second"]  # unranked and missing cells skipped
    t.higher_is_better = False
    rank(t)
    assert [r.cells[0].mark for r in t.rows] == ["", "", "second", "best"]

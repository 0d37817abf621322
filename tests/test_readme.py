"""The README's first screen leads with use (issue 36): what the project is, the two commands, and
the DVC workflow a researcher lives in; `dvc exp show` appears first with the options that make it
readable; the results table shows the strongest baseline on that dataset, not only the others."""

from __future__ import annotations

from support import ROOT

README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:45])


def test_the_first_screen_has_the_two_commands_and_the_dvc_workflow():
    for command in ("make repro", "make test", "halludetect exp run -S", "exp run --queue", "halludetect sweep"):
        assert command in FIRST_SCREEN, command
    for command in ("dvc push", "halludetect exp-push", "halludetect train-layer"):
        assert command in FIRST_SCREEN, command
    assert "dvc.lock" not in FIRST_SCREEN and "EPYC-Rome" not in FIRST_SCREEN  # notes for later, further down


def test_dvc_exp_show_first_appears_with_its_readable_options():
    first = README.index("dvc exp show")
    command = README[first : README.index("\n", README.index("--keep", first))]
    assert "--only-changed" in command and "--drop" in command and "--keep" in command, command


def test_the_results_table_shows_the_strongest_baseline_first():
    """The answer's own log-prob (the world's strongest score, 0.952 in the fresh-clone run the table
    reports) leads the table, above every method and baseline beside it."""
    section = README.split("## Results on the demo world\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line.split("|")[2][1:2].isdigit()]
    strongest = rows[0]
    assert strongest.startswith("| Answer log-prob, the strongest baseline here"), rows
    auroc = float(strongest.split("|")[2].split()[0])
    assert auroc == 0.952 and all(auroc > float(r.split("|")[2].split()[0]) for r in rows[1:])


def test_the_front_page_is_short_and_its_map_names_every_page():
    """Issue 35: the front page at most ~150 lines, the map of every docs page on its first screen."""
    assert len(README.splitlines()) <= 150
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages and [p for p in pages if f"(docs/{p})" not in FIRST_SCREEN] == []

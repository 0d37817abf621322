"""The leak flag of the tables (halludetect/report/leaks.py): a dataset above report.leak_threshold
is marked in its columns and rows with a note saying why; one below is not; a prepare JSON
without the check is an error naming the file and the fix."""

import json

import pytest

from halludetect.core.errors import UserError
from halludetect.report.leaks import MARK, flag_leaks, load_leaks
from halludetect.report.tables import Cell, Row, Table, to_latex, to_markdown


def tables() -> list[Table]:
    by_column = Table(
        "auroc", "Test AUROC", "Method", [("llama", ["squad", "trivia_qa"])], [Row("Max", [Cell(0.9), Cell(0.8)])]
    )
    by_row = Table(
        "label_distribution",
        "Labels",
        "Model / dataset / split",
        [("", ["Pos."])],
        [Row("llama / squad / test", [Cell(3, fmt="int")]), Row("llama / trivia_qa / test", [Cell(4, fmt="int")])],
    )
    return [by_column, by_row]


def test_a_dataset_above_the_threshold_is_marked_with_the_reason():
    auroc, labels = flag_leaks(tables(), {"squad": 0.97, "trivia_qa": 0.04}, 0.1, ["llama"])
    assert auroc.groups == [("llama", [f"squad {MARK}", "trivia_qa"])]
    assert [r.label for r in labels.rows] == [f"llama / squad {MARK} / test", "llama / trivia_qa / test"]
    md = to_markdown(auroc)
    assert "| Method | llama / squad [leak] | llama / trivia_qa |" in md
    note = md.splitlines()[-1]
    assert note.startswith("- [leak]: the prompt the model sees holds a reference answer for more than 10% ")
    assert "(squad 97.0%; report.leak_threshold" in note and "similarity baselines" in note
    assert "trivially strong" in to_latex(auroc) and r"10\%" in to_latex(auroc)


def test_no_dataset_above_the_threshold_marks_nothing():
    before = [to_markdown(t) for t in tables()]
    after = [to_markdown(t) for t in flag_leaks(tables(), {"squad": 0.1, "trivia_qa": 0.04}, 0.1, ["llama"])]
    assert after == before  # "above": a share equal to the threshold is not flagged


@pytest.mark.hostile
def test_report_names_a_prepare_json_without_the_leak_check_and_the_fix(tmp_path):
    (tmp_path / "squad.json").write_text(json.dumps({"questions": 3, "leak": {"prompt_fraction": 0.5}}))
    assert load_leaks(tmp_path, ["squad"]) == {"squad": 0.5}
    (tmp_path / "old.json").write_text(json.dumps({"questions": 3}))
    with pytest.raises(UserError, match=r"old.json: no leak check .*re-run it \(`dvc repro prepare@old`\)"):
        load_leaks(tmp_path, ["old"])
    with pytest.raises(UserError, match=r"nq.json: missing; run `dvc repro prepare@nq`"):
        load_leaks(tmp_path, ["nq"])

"""The `halludetect` command (halludetect/cli.py): bad input is one line on stderr and exit status 2,
and `show` prints a bundle's metadata."""

import json

import pytest
from support import write_jsonl


def test_the_command_reports_bad_input_in_one_line_and_exits_2(bundle_path, tiny_model_dir, tmp_path, capsys):
    from halludetect import cli as console

    def fails(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as e:
            console.main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "no such bundle" in fails(["show", str(tmp_path / "none.safetensors")])
    score = ["score", "--bundle", str(bundle_path), "--model", str(tiny_model_dir), "--out", str(tmp_path / "o.jsonl")]
    assert "pass --generate, or drop them" in fails([*score, "--input", "in.jsonl", "--seed", "3"])
    assert "no such input file" in fails([*score, "--input", str(tmp_path / "none.jsonl")])
    src = write_jsonl(tmp_path / "in.jsonl", [{"question": "Q?", "answer": "A."}])
    assert "unknown threshold 'f1'" in fails([*score, "--input", str(src), "--threshold", "f1"])
    console.main(["show", str(bundle_path)])
    assert json.loads(capsys.readouterr().out)["method"] == "max"


def test_score_explain_writes_the_evidence_columns_and_explain_renders_them(
    bundle_path, tiny_model_dir, tmp_path, capsys
):
    import polars as pl

    from halludetect import cli as console

    rows = [
        {"id": "a1", "question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar."},
        {"id": "a2", "question": "Where was Tavo Mir born?", "answer": ""},
        {"id": "a3", "question": "What is the job of Tavo Mir?", "answer": "A <b>baker</b> & more."},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "explained.parquet"
    base = ["score", "--bundle", str(bundle_path), "--model", str(tiny_model_dir), "--input", str(src)]
    console.main([*base, "--out", str(out), "--explain", "--device", "cpu", "--no-progress"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["evidence"].startswith("each feature's term")
    df = pl.read_parquet(out)
    assert df.columns == [
        "row",
        "id",
        "n_tokens",
        "score",
        "probability",
        "flag",
        "reason",
        "question",
        "answer",
        "tokens",
        "token_start",
        "token_end",
        "offsets_exact",
        "contributions",
        "bias",
    ]
    scored = df.filter(pl.col("reason").is_null())
    for r in scored.iter_rows(named=True):
        assert abs(r["bias"] + sum(r["contributions"]) - r["score"]) < 1e-5
    console.main(["explain", str(out), "--color", "never"])
    text = capsys.readouterr().out
    assert "2 of 2 scored answers" in text and "not scored: empty_answer 1" in text and "<b>baker</b>" in text
    page = tmp_path / "page.html"
    console.main(["explain", str(out), "--html", str(page), "--limit", "1"])
    assert "written:" in capsys.readouterr().err
    html = page.read_text()
    assert html.count('<section class="answer"') == 1 and "Showing the 1 highest-scored of 2 scored answers" in html
    with pytest.raises(SystemExit) as e:
        console.main(["explain", str(src)])
    assert e.value.code == 2 and "score the answers with `halludetect score --explain`" in capsys.readouterr().err

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

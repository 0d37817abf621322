"""The `halludetect` command (halludetect/cli.py): bad input is one line on stderr and exit status 2,
and `show` prints a bundle's metadata (for hami_sp, what its P_sem input must be)."""

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


def test_show_says_which_p_sem_variant_and_how_many_answers_a_hami_sp_bundle_needs(bundle_path, tmp_path, capsys):
    from halludetect import cli as console
    from halludetect.detectors.build import build_detector, params_for
    from halludetect.scoring.bundle import load_bundle, p_sem_inputs, save_bundle

    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta))
    params = params_for("hami_sp", {"dim": 8}).model_dump()
    made = {"samples_per_question": 5.0, "equivalence": "paper", "backend": "openai"}
    meta |= {"method": "hami_sp", "params": params}
    meta["inputs"] |= p_sem_inputs("hami_sp", params, made)
    assert meta["inputs"]["p_sem"] == {"variant": "sum", "lam": 1.0, **made}
    out = tmp_path / "sp.safetensors"
    save_bundle(
        out, {s: build_detector("hami_sp", 32, params_for("hami_sp", params)).state_dict() for s in b.seeds}, meta
    )
    console.main(["show", str(out)])
    needs = json.loads(capsys.readouterr().out)["needs"]
    assert "K = 5.0 answers per question" in needs and "P_sem variant 'sum'" in needs
    assert "paper equivalence rule (openai NLI)" in needs and "(1 + 1.0 p_sem)" in needs
    console.main(["show", str(bundle_path)])  # a bundle that reads no P_sem needs nothing more
    assert "needs" not in json.loads(capsys.readouterr().out)
    with pytest.raises(Exception, match="must say how P_sem was made"):
        p_sem_inputs("hami_sp", params, None)
    assert p_sem_inputs("max", {}, None) == {}

"""The `halludetect` command (halludetect/cli/): bad input is one line on stderr and exit status 2,
and `show` summarises a bundle for a person, or prints its metadata with --json (for hami_sp, what its
P_sem input must be)."""

import json

import pytest
from support import ROOT, write_jsonl


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
    console.main(["show", str(bundle_path), "--json"])
    assert json.loads(capsys.readouterr().out)["method"] == "max"


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--threshold", "nan"], "threshold 'nan' is not a finite logit: give one this bundle stores (best_f1, "),
        (["--threshold=-inf"], "threshold '-inf' is not a finite logit"),
        (["--batch-size", "many"], "halludetect score: argument --batch-size: invalid int value: 'many' (see "),
        (["--threshold", "f1"], "unknown threshold 'f1': this bundle has best_f1, fpr_0.01"),
        (["--batch-size", "0"], "batch_size (--batch-size) must be a whole number of at least 1, got 0"),
        (["--rows-per-part", "-1"], "rows_per_part (--rows-per-part) must be a whole number of at least 1, got -1"),
        (["--generate", "--max-new-tokens", "0"], "generate.max_new_tokens: input should be greater than 0 (got 0)"),
        (
            ["--device", "banana"],
            "--device: 'banana' is not a device; use auto, cpu, cuda, cuda:N (a GPU index) or mps",
        ),
        (
            ["--device-map", "banana"],
            "halludetect score: argument --device-map: 'banana' is not a device map; use auto, balanced, ",
        ),
        (["--revision", "main"], "--revision main was given with the local model directory "),
        (["--out", "{input}"], "the output (--out) {input} is the input (--input) {input}: writing it would destroy"),
        (["--out", "{tmp}"], "the output (--out) {tmp} is a directory: give a file path in it"),
        (["--out", "{tmp}/no/o.jsonl"], "the output (--out) {tmp}/no/o.jsonl: its folder {tmp}/no does not exist"),
        (["--summary", "{input}"], "the summary (--summary) {input} is the input (--input) {input}: writing it"),
    ],
)
def test_bad_score_arguments_are_one_line_and_exit_2_with_the_input_untouched(
    bundle_path, tiny_model_dir, tmp_path, capsys, no_loading, extra, message
):
    """Each bad argument of `halludetect score`: one line on stderr naming it and the fix, exit 2,
    before any weights load (no_loading), the input as it was and no output."""
    from halludetect import cli as console

    src = write_jsonl(tmp_path / "in.jsonl", [{"question": "Q?", "answer": "A."}])
    before = src.read_bytes()
    fill = lambda text: text.replace("{input}", str(src)).replace("{tmp}", str(tmp_path))  # noqa: E731
    argv = ["score", "--bundle", str(bundle_path), "--model", str(tiny_model_dir), "--input", str(src)]
    extra = [fill(x) for x in extra]
    if "--out" not in extra:
        extra += ["--out", str(tmp_path / "o.jsonl")]
    if "--generate" in extra:  # questions alone
        src.write_text('{"question": "Q?"}\n')
        before = src.read_bytes()
    with pytest.raises(SystemExit) as e:
        console.main([*argv, *extra])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.startswith(f"error: {fill(message)}") and err.count("\n") == 1, err
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out-dir", "{tmp}/file.md"], "--out-dir {tmp}/file.md is a file, not a directory: give a directory"),
        (["--out-dir", "{tmp}/file.md/sweeps"], "--out-dir {tmp}/file.md/sweeps: {tmp}/file.md is a file, so the"),
        (["--where", "train.epochs"], "--where 'train.epochs': write KEY=VALUE, e.g. --where train.epochs=100"),
        (["--params", "{tmp}/nope.yaml"], "{tmp}/nope.yaml: no such params file (run from the repository root)"),
    ],
)
def test_bad_sweep_arguments_are_one_line_and_exit_2_before_dvc_is_asked(tmp_path, capsys, monkeypatch, argv, message):
    """Checked before the experiments are read (there is no DVC repository here to read)."""
    from halludetect import cli as console

    (tmp_path / "file.md").write_text("kept")
    monkeypatch.chdir(tmp_path)
    fill = lambda text: text.replace("{tmp}", str(tmp_path))  # noqa: E731
    with pytest.raises(SystemExit) as e:
        console.main(["sweep", "detectors.max.dim", "--params", str(ROOT / "params.yaml"), *map(fill, argv)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {fill(message)}")
    assert (tmp_path / "file.md").read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["file.md"]


@pytest.mark.hostile
def test_a_swept_parameter_that_does_not_exist_is_one_line_naming_the_valid_ones(tmp_path, capsys, monkeypatch):
    from halludetect import cli as console

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        console.main(["sweep", "detectors.max.width", "--params", str(ROOT / "params.yaml")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: the swept parameter detectors.max.width is not a parameter of params.yaml; ")
    assert "The keys of detectors.max: detectors.max.dim, detectors.max.dropout" in err


def test_show_says_which_p_sem_variant_and_how_many_answers_a_hami_sp_bundle_needs(bundle_path, tmp_path, capsys):
    from halludetect import cli as console
    from halludetect.detectors.build import build_detector, params_for
    from halludetect.scoring.bundle import load_bundle, save_bundle
    from halludetect.scoring.export import p_sem_inputs

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
    console.main(["show", str(out), "--json"])
    needs = json.loads(capsys.readouterr().out)["needs"]
    assert "K = 5.0 answers per question" in needs and "P_sem variant 'sum'" in needs
    assert "paper equivalence rule (openai NLI)" in needs and "(1 + 1.0 p_sem)" in needs
    console.main(["show", str(out)])  # the summary says it too
    assert f"needs {needs}" in capsys.readouterr().out
    console.main(["show", str(bundle_path), "--json"])  # a bundle that reads no P_sem needs nothing more
    assert "needs" not in json.loads(capsys.readouterr().out)
    with pytest.raises(Exception, match="must say how P_sem was made"):
        p_sem_inputs("hami_sp", params, None)
    assert p_sem_inputs("max", {}, None) == {}


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
        "in_distribution",
        "ood_reason",
        "mean_logprob",
        "min_logprob",
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
    # bad output paths and limits: one line each, before the file is read, nothing written
    for extra, message in (
        (["--html", str(tmp_path)], f"the page (--html) {tmp_path} is a directory: give a file path in it"),
        (["--html", str(tmp_path / "no" / "p.html")], f"the page (--html) {tmp_path / 'no' / 'p.html'}: its folder"),
        (["--html", str(out)], f"the page (--html) {out} is the scores file {out}: writing it would destroy"),
        (["--limit", "0"], "--limit must be at least 1, got 0"),
    ):
        with pytest.raises(SystemExit) as e:
            console.main(["explain", str(out), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert pl.read_parquet(out).height == 3


def test_show_prints_the_summary_and_json_the_raw_metadata(bundle_path, capsys):
    from halludetect import cli as console
    from halludetect.scoring.bundle import load_bundle
    from halludetect.scoring.bundle_summary import summary_text

    b = load_bundle(bundle_path)
    console.main(["show", str(bundle_path), "--json"])
    assert json.loads(capsys.readouterr().out) == {"sha256": b.sha256, **b.meta}
    console.main(["show", str(bundle_path)])
    out, err = capsys.readouterr()
    assert out == summary_text(b) + "\n" and err == ""

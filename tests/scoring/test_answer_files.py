"""Answer files (halludetect/scoring/answer_files.py): malformed JSON Lines and Parquet rows are named by
line or row before the model loads, and reading rows is streamed (memory of one part, not the file)."""

import shutil

import polars as pl
import pytest
from support import write_jsonl

from halludetect.config import GenerateParams
from halludetect.scoring.answer_files import InputError
from halludetect.scoring.scorer import score_file


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (
            [{"question": "Q?", "answer": "A."}, "{not json", {"question": "Q?", "answer": "A."}],
            r"in\.jsonl, line 2: not valid JSON",
        ),
        (
            [{"question": "Q?", "answer": "A."}, {"question": "Q?"}],
            r"line 2: 'answer' must be a string \(missing; .*--generate",
        ),
        ([{"question": "", "answer": "A."}], "line 1: 'question' must be a non-empty string"),
        (
            [{"id": 1, "question": "Q?", "answer": "A."}, {"id": "b", "question": "Q?", "answer": "A."}],
            "line 2: 'id' is str here but int at line 1",
        ),
        (
            [{"question": "Q?", "answer": "A.", "answer_token_ids": [1, "x"]}],
            "line 1: 'answer_token_ids' must be a list",
        ),
        (
            [{"question": "Q?", "answer": "A.", "answer_token_ids": [1, 10**6]}],
            "line 1: answer_token_ids 1000000 is outside the model's vocabulary",
        ),
        ([{"question": "Q?", "answer": "A.", "p_sem": 1.5}], r"line 1: 'p_sem' must be a number in \[0, 1\]"),
        ([[1, 2]], "line 1: expected a JSON object, got list"),
    ],
)
def test_malformed_rows_are_named_before_the_model_loads(
    bundle_path, tiny_model_dir, tmp_path, no_loading, rows, match
):
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(InputError, match=match):
        score_file(bundle_path, src, tmp_path / "out.parquet", str(tiny_model_dir), progress=False)
    assert not (tmp_path / "out.parquet").exists()


def test_malformed_parquet_rows_are_named(bundle_path, tiny_model_dir, tmp_path, no_loading):
    src = tmp_path / "in.parquet"
    pl.DataFrame({"question": ["Q?", "Q?", None], "answer": ["A.", "B.", "C."]}).write_parquet(src)
    with pytest.raises(InputError, match=r"in\.parquet, row 2: 'question' must be a non-empty string"):
        score_file(bundle_path, src, tmp_path / "out.jsonl", str(tiny_model_dir), progress=False)
    with pytest.raises(InputError, match="unknown output format '.csv'"):
        score_file(bundle_path, src, tmp_path / "out.csv", str(tiny_model_dir), progress=False)
    pl.DataFrame({"question": ["Q?"]}).write_parquet(src)
    with pytest.raises(InputError, match="'answer' must be a string"):
        score_file(bundle_path, src, tmp_path / "out.jsonl", str(tiny_model_dir), progress=False)
    with pytest.raises(InputError, match="--generate samples the answers"):
        score_file(
            bundle_path,
            write_jsonl(tmp_path / "q.jsonl", [{"question": "Q?", "answer": "A."}]),
            tmp_path / "out.jsonl",
            str(tiny_model_dir),
            generate=GenerateParams(),
            progress=False,
        )


def test_reading_rows_is_streamed(tmp_path):
    """The first pass and the parts keep one part of rows at a time: the peak of Python
    allocations while reading 20,000 rows is that of reading 2,000."""
    import tracemalloc

    from halludetect.scoring.answer_files import AnswerFile

    def peak(n: int) -> int:
        rows = [
            {"id": i, "question": f"Where was Tavo Mir{i} born?", "answer": "Tavo Mir was born in " + "x" * 80}
            for i in range(n)
        ]
        src = write_jsonl(tmp_path / f"{n}.jsonl", rows)
        del rows
        tracemalloc.start()
        f = AnswerFile(src).check()
        parts = sum(len(p) for _, p in f.parts(500))
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert f.n_rows == parts == n
        return top

    small, large = peak(2_000), peak(20_000)
    assert large < 1.5 * small, (small, large)


# ------------------------------------------------------------------ hostile files and paths
@pytest.mark.hostile
def test_answers_that_are_not_utf8_are_named_by_line(bundle_path, tiny_model_dir, tmp_path, no_loading):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"question": "Q?", "answer": "A."}\n{"question": "Wo ist M\xfcnchen?", "answer": "A."}\n')
    before = src.read_bytes()
    with pytest.raises(InputError) as e:
        score_file(bundle_path, src, tmp_path / "out.parquet", str(tiny_model_dir), progress=False)
    assert str(e.value) == (
        f"{src}, line 2: not UTF-8 (byte 0xfc at column 23); re-save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`"
    )
    assert src.read_bytes() == before and not (tmp_path / "out.parquet").exists()


def damaged_parquet(path):
    """A Parquet file whose footer (schema, offsets) reads but whose data pages are garbage."""
    rows = [{"question": f"Where was person {i} born?", "answer": f"In city {i * 7919 % 1000}."} for i in range(3000)]
    pl.DataFrame(rows).write_parquet(path, compression="zstd")
    data = bytearray(path.read_bytes())
    data[200:1200] = bytes((i * 37 + 11) % 256 for i in range(1000))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.hostile
def test_a_parquet_file_damaged_in_its_data_pages_is_named(bundle_path, tiny_model_dir, tmp_path, no_loading):
    import pyarrow.parquet as pq

    src = damaged_parquet(tmp_path / "in.parquet")
    pq.ParquetFile(src)  # the footer reads: the damage shows only in the data
    before = src.read_bytes()
    with pytest.raises(
        InputError, match=rf"^{src}: damaged Parquet data in its first rows \(.+\); write the file again$"
    ):
        score_file(bundle_path, src, tmp_path / "out.jsonl", str(tiny_model_dir), progress=False)
    assert src.read_bytes() == before and not (tmp_path / "out.jsonl").exists()


@pytest.mark.hostile
def test_an_output_that_is_the_input_the_bundle_or_a_directory_is_refused_naming_both(
    bundle_path, tiny_model_dir, tmp_path, no_loading
):
    """Before: `--out` equal to `--input` overwrote the answers with their scores."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"question": "Q?", "answer": "A."}])
    (tmp_path / "link.jsonl").symlink_to(src)
    before, bundle_bytes = src.read_bytes(), bundle_path.read_bytes()
    score = lambda out, **kw: score_file(bundle_path, src, out, str(tiny_model_dir), progress=False, **kw)  # noqa: E731
    for out in (src, tmp_path / "link.jsonl"):
        with pytest.raises(InputError) as e:
            score(out)
        assert str(e.value) == (
            f"the output (--out) {out} is the input (--input) {src}: writing it would destroy what this run "
            "reads; give another path"
        )
    odd = tmp_path / "bundle.jsonl"  # a bundle under an output's name (the format is in the file, not its name)
    shutil.copy(bundle_path, odd)
    with pytest.raises(InputError, match=rf"^the output \(--out\) {odd} is the bundle \(--bundle\) {odd}: writing"):
        score_file(odd, src, odd, str(tiny_model_dir), progress=False)
    assert odd.read_bytes() == bundle_bytes
    (tmp_path / "scores.jsonl").mkdir()
    with pytest.raises(InputError, match=rf"^the output \(--out\) {tmp_path / 'scores.jsonl'} is a directory: give a "):
        score(tmp_path / "scores.jsonl")
    with pytest.raises(InputError, match=rf"its folder {tmp_path / 'no' / 'such'} does not exist \(create it first"):
        score(tmp_path / "no" / "such" / "scores.jsonl")
    assert src.read_bytes() == before
    assert not (tmp_path / "no").exists() and not list((tmp_path / "scores.jsonl").iterdir())

"""Answer files (halludetect/scoring/answer_files.py): malformed JSON Lines and Parquet rows are named by
line or row before the model loads, and reading rows is streamed (memory of one part, not the file)."""

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

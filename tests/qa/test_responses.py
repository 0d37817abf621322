"""Which answers the detectors see (halludetect/qa/responses.py): train keeps its first samples, val and
test all of them, empty answers are excluded and counted, and the response id is the same string in
Python and in polars."""

import polars as pl

from halludetect.qa.responses import response_id, response_ids, select_answers


def generations() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "question_id": ["t1", "t1", "t1", "v1", "v1", "x1", "x1"],
            "sample_index": [0, 1, 2, 0, 1, 0, 1],
            "split": ["train"] * 3 + ["val"] * 2 + ["test"] * 2,
            "n_tokens": [3, 4, 5, 2, 0, 0, 6],
        }
    )


def test_train_keeps_its_first_samples_and_val_test_all_but_the_empty_ones():
    chosen, excluded = select_answers(generations())
    assert list(zip(chosen["question_id"], chosen["sample_index"])) == [("t1", 0), ("v1", 0), ("x1", 1)]
    assert excluded == {"empty_answer": 2}
    two, excluded = select_answers(generations(), n_train_samples=2)
    assert two.filter(pl.col("split") == "train")["sample_index"].to_list() == [0, 1]
    assert excluded == {"empty_answer": 2}  # the empty val and test answers, never a bag


def test_response_ids_match_in_python_and_polars():
    df = generations()
    ids = df.select(response_ids(df).alias("id"))["id"].to_list()
    assert ids == [response_id(q, s) for q, s in zip(df["question_id"], df["sample_index"])]
    assert ids[0] == "t1/0"

"""A score with nothing to train is a function in evaluation/baselines.py and a declaration in
methods/scores.py: the example of docs/detectors.md "Adding a score", added to a copy of the code
as written, is accepted by grid.detectors with its params section, computed by the function its
train stage calls, named by the report, and its own digest of the train stage holds its code."""

from __future__ import annotations

from support import copy_of_the_code, doc_blocks, run_in_copy

CHECK = """
import json, polars as pl, yaml
import halludetect
from halludetect.config import parse_params
from halludetect.core import code_deps
from halludetect.evaluation.baselines import baseline_scores
from halludetect.methods import SCORES
from halludetect.report.cells import NAMES, family, marked

data = yaml.safe_load(open("params.yaml"))
data["grid"]["detectors"] = [*data["grid"]["detectors"], "max_surprise"]
data["detectors"]["max_surprise"] = {}
params = parse_params(data)
generations = pl.DataFrame({
    "question_id": ["q1", "q1", "q2"], "sample_index": [0, 1, 0], "n_tokens": [2, 0, 1], "text": ["a b", "", "c"],
    "token_logprobs": [[-0.1, -2.5], [], [-0.2]],
})
scores = baseline_scores("max_surprise", generations, None, params.detectors.max_surprise)
print(json.dumps({
    "file": halludetect.__file__, "listed": "max_surprise" in params.grid.detectors, "scores": scores.rows(),
    "name": NAMES["max_surprise"], "family": family("max_surprise"), "marked": marked("max_surprise", {}),
    "stage_code": [code_deps.relative(p) for p in code_deps.closure("stages.train", method="max_surprise")],
    "digests": sorted(k for k in code_deps.digests() if "max_surprise" in k),
    "compute": SCORES["max_surprise"].compute,
}))
"""


def test_adding_a_score_is_a_function_and_a_declaration(tmp_path):
    copy = copy_of_the_code(tmp_path)
    function, declaration = doc_blocks("docs/detectors.md", "Adding a score")["python"]
    with open(copy / "halludetect" / "evaluation" / "baselines.py", "a") as f:
        f.write("\n\n" + function)
    with open(copy / "halludetect" / "methods" / "scores.py", "a") as f:
        f.write("\n" + declaration)
    got = run_in_copy(copy, CHECK)
    assert got["file"].startswith(str(copy))  # the copy's code ran, not this checkout's
    assert got["listed"] and got["name"] == "Max token surprise" and got["family"] == "field"
    assert got["scores"] == [["q1/0", 2.5], ["q2/0", 0.2]]  # the empty answer has no score
    assert got["marked"] == "Max token surprise [token log-probs]"  # its declared needs, before any metrics
    module = got["compute"].partition(":")[0].replace(".", "/") + ".py"
    assert module == "halludetect/evaluation/baselines.py" and module in got["stage_code"]
    assert got["digests"] == ["evaluate/max_surprise.txt", "train/max_surprise.txt"]

"""Adding a judge backend (docs/labels.md, "Adding a judge backend"): one file and one registry line
in a copy of the code."""

from __future__ import annotations

from support import copy_of_the_code, doc_blocks, register_in_copy, run_in_copy

from halludetect.core import code_deps

ROOT = code_deps.ROOT

CHECK = """
import json
import polars as pl
from halludetect.config import parse_params
from halludetect.core import code_deps, yaml12
from halludetect.labels.judges import JudgeItem, get_judge, two_pass

data = yaml12.load(open("params.yaml").read())
data["judge"]["backend"] = "exact"
params = parse_params(data)
judge = get_judge(params.judge.backend)
verdicts = judge.judge([JudgeItem("q", "  Paris ", ("paris",)), JudgeItem("q", "Lyon", ("Paris",))], True)
try:
    parse_params(dict(data, judge={"backend": "exactt"}))
    refused = None
except Exception as e:
    refused = str(e)
digests = code_deps.digests()
print(json.dumps({
    "verdicts": [v.verdict for v in verdicts], "name": judge.name, "refused": refused,
    "judge_digest": "halludetect/labels/judges/exact.py" in digests["judge.txt"],
    "cluster_digest": "halludetect/labels/judges/exact.py" in digests["cluster.txt"],
}))
"""


def test_adding_a_judge_backend_in_a_copy_of_the_code(tmp_path):
    """The docs' backend file and registry line make `judge.backend: exact` a judge: params accept it,
    it judges, a misspelling is refused with a did-you-mean, and the judge stage's digest (only) holds
    its file."""
    copy = copy_of_the_code(tmp_path)
    module, line = doc_blocks("docs/labels.md", "Adding a judge backend")["python"]
    (copy / "halludetect" / "labels" / "judges" / "exact.py").write_text(module)
    register_in_copy(copy, "judge", line)
    got = run_in_copy(copy, CHECK)
    assert got["verdicts"] == ["yes", "no"] and got["name"] == "exact"
    assert "unknown judge backend (judge.backend) 'exactt'; did you mean 'exact'?" in got["refused"]
    assert got["judge_digest"] and not got["cluster_digest"]

"""Adding a dataset (docs/datasets.md, "Adding a dataset"): a preset with a format of its own in
params.yaml alone, or a format file and one registry line in a copy of the code."""

from __future__ import annotations

import json

from support import copy_of_the_code, doc_blocks, register_in_copy, run_in_copy

from halludetect.core import code_deps

ROOT = code_deps.ROOT

CHECK = """
import json, sys
import datasets as hf
import halludetect
assert halludetect.__file__.startswith(sys.argv[1]), halludetect.__file__  # the copy, not the checkout
from halludetect.config import load_params, parse_params, PrepareParams
from halludetect.core import code_deps, yaml12
from halludetect.qa.datasets import prepare

data = yaml12.load(open("params.yaml").read())
data["datasets"]["my_eli5"] = {"loader": "eli5", "path": "eli5.jsonl"}
data["datasets"].update(yaml12.load(open("inline.yaml").read())["datasets"])
params = parse_params(data)
thirds = PrepareParams(train=0.4, val=0.3, test=0.3)
local, report = prepare(params.dataset("my_eli5"), thirds, "my_eli5")

calls = []
def load_dataset(hf_id, config=None, *, split, revision=None):
    calls.append([hf_id, config, split])
    return [{"question": f"Who wrote book {i}?", "answer": {"value": f"Author {i}", "aliases": [f"A. {i}"]}}
            for i in range(10)]
hf.load_dataset = load_dataset
web, _ = prepare(params.dataset("trivia_web").model_copy(update={"sizes": None}), thirds, "trivia_web")
tsv, _ = prepare(params.dataset("my_tsv"), thirds, "my_tsv")

wrong = dict(data, datasets=dict(data["datasets"], my_eli5={"loader": "eli55", "path": "eli5.jsonl"}))
try:
    parse_params(wrong)
    refused = None
except Exception as e:
    refused = str(e)
print(json.dumps({
    "local": sorted(local["question"].to_list()), "answers": local.sort("question")["answers"].to_list()[0],
    "web": sorted(web["answers"].to_list())[0], "calls": calls, "refused": refused,
    "digest": "halludetect/qa/formats/eli5.yaml" in code_deps.digests()["prepare.txt"],
    "judge_digest": "halludetect/qa/formats/eli5.yaml" in code_deps.digests()["judge.txt"],
    "tsv": tsv.sort("id")["answers"].to_list()[:2],
    "reader_digest": "halludetect/qa/tsv_reader.py" in code_deps.digests()["prepare.txt"],
}))
"""


TSV_READER = """
def read(path, report):
    rows = [line.split("\\t") for line in path.read_text().splitlines()]
    report.read = len(rows)
    return [(f"{path}:{n}", {"id": i, "question": q, "answers": [a]}) for n, (i, q, a) in enumerate(rows, 1)]
"""


def test_adding_a_dataset_in_a_copy_of_the_code(tmp_path):
    """The docs' format file and registry line, dropped into a copy of the code, make a loader every
    preset can name: prepare reads a local file of that shape, a misspelt loader is refused with a
    did-you-mean, and the code stage puts the file in prepare's digest (not the judge's). The docs'
    inline preset (params alone) reads its hub rows through its own field map."""
    copy = copy_of_the_code(tmp_path)
    blocks = doc_blocks("docs/datasets.md", "Adding a dataset")
    inline, fmt = blocks["yaml"]
    (copy / "inline.yaml").write_text(inline)
    (copy / "halludetect" / "qa" / "formats" / "eli5.yaml").write_text(fmt)
    register_in_copy(copy, "dataset", blocks["python"][0])
    rows = [
        {"id": f"e{i}", "title": f"Why is the sky {i}?", "answer_texts": [f"light {i}", "Rayleigh"]} for i in range(10)
    ]
    # a preset's own format naming a reader of the repository: prepare runs it, its digest holds it
    (copy / "halludetect" / "qa" / "tsv_reader.py").write_text(TSV_READER)
    (copy / "qa.tsv").write_text("".join(f"t{i}\tWhat is {i} + 1?\t{i + 1}\n" for i in range(10)))
    params = (
        (copy / "params.yaml")
        .read_text()
        .replace(
            "\ndatasets:\n",
            "\ndatasets:\n  my_tsv:\n    format: {reader: 'halludetect.qa.tsv_reader:read'}\n    path: qa.tsv\n",
            1,
        )
    )
    (copy / "params.yaml").write_text(params)
    (copy / "eli5.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = run_in_copy(copy, CHECK, str(copy))
    assert got["local"] == sorted(r["title"] for r in rows)
    assert got["answers"] == ["light 0", "Rayleigh"]
    assert got["calls"] == [["trivia_qa", "rc.web.nocontext", "validation"]]
    assert got["web"] == ["Author 0", "A. 0"]
    assert "unknown dataset loader (datasets.<name>.loader) 'eli55'; did you mean 'eli5'?" in got["refused"]
    assert got["digest"] and not got["judge_digest"]
    assert got["tsv"] == [["1"], ["2"]] and got["reader_digest"]


def test_a_format_of_the_preset_is_checked_with_the_params():
    """An inline format's mistakes are params errors naming the key, before any stage works."""
    import pytest

    from halludetect.config import ParamsError, parse_params
    from halludetect.core.yaml12 import load

    base = load((ROOT / "params.yaml").read_text())
    hub = {"id": "org/qa", "split": "validation"}
    cases = {
        "datasets.mine.format.fieldz: unknown key; did you mean 'fields'?": {
            "format": {"hub": hub, "fieldz": {"question": "q", "answers": "a"}}
        },
        "a hub format maps at least question and answers in fields": {
            "format": {"hub": hub, "fields": {"question": "q"}}
        },
        "format describes the dataset itself: remove loader": {
            "loader": "nq",
            "format": {"hub": hub, "fields": {"question": "q", "answers": "a"}},
        },
        "a format without hub reads a local file: set 'path'": {"format": {"question_suffix": "?"}},
        "loader 'bioasq' reads a local file: set 'path'": {"loader": "bioasq"},
        "datasets.mine.format.fields.answer.[key]: Input should be 'id', 'question', 'answers'": {
            "format": {"hub": hub, "fields": {"question": "q", "answer": "a"}}
        },
    }
    for wanted, preset in cases.items():
        data = {**base, "datasets": {**base["datasets"], "mine": preset}}
        with pytest.raises(ParamsError) as e:
            parse_params(data)
        assert wanted in str(e.value), (wanted, str(e.value))

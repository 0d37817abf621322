"""The registry of detection methods (halludetect/methods/): one file declares a method, and the
params, the trait lists, the report and the code stage's digests follow from it."""

from __future__ import annotations

import subprocess
import sys

from support import copy_of_the_code, doc_blocks, run_in_copy

from halludetect.config import DetectorsParams
from halludetect.core import code_deps
from halludetect.detectors.build import build_detector, params_for
from halludetect.methods import METHODS
from halludetect.report.cells import NAMES

ROOT = code_deps.ROOT

CHECK = """
import json, torch, yaml
import halludetect
assert halludetect.__file__.startswith(".") or "/work/main" not in halludetect.__file__, halludetect.__file__
from halludetect.config import parse_params
from halludetect.activations.bags import Bags
from halludetect.detectors.build import build_detector
from halludetect.methods import SP_METHODS
from halludetect.report.cells import NAMES
from halludetect.core import code_deps

data = yaml.safe_load(open("params.yaml"))
data["grid"]["detectors"] = [*data["grid"]["detectors"], "wide_max"]
data["detectors"]["wide_max"] = {"dim": 4}
params = parse_params(data)
bags = Bags(torch.randn(5, 3), torch.tensor([2, 3]), torch.tensor([0.5, 0.2]))
z = build_detector("wide_max", 3, params.detectors.wide_max)(bags)
wrong = dict(data, detectors=dict(data["detectors"], wide_max={"dim": 4, "dimm": 5}))
try:
    parse_params(wrong)
    refused = None
except Exception as e:
    refused = str(e)
print(json.dumps({"shape": list(z.shape), "dim": params.detectors.wide_max.dim, "sp": "wide_max" in SP_METHODS,
                  "name": NAMES["wide_max"], "refused": refused,
                  "train_runs_it": "halludetect/methods/wide_max.py" in
                      [code_deps.relative(p) for p in code_deps.closure("stages.train")],
                  "own_digest": "halludetect/methods/wide_max.py" in code_deps.digests()["train/wide_max.txt"],
                  "others_digest": "halludetect/methods/wide_max.py" in code_deps.digests()["train/max.txt"]}))
"""


def test_every_method_has_a_params_section_a_display_name_and_builds():
    assert list(DetectorsParams.model_fields)[: len(METHODS)] == list(METHODS)  # then the scores' sections
    for name, m in METHODS.items():
        assert DetectorsParams.model_fields[name].annotation is m.params
        assert NAMES[name] == m.display
        params = params_for(name, {"dim": 4} if "dim" in m.params.model_fields else {})
        assert hasattr(build_detector(name, 6, params), "forward")


def test_adding_a_method_is_one_file(tmp_path):
    """The example of docs/detectors.md "Adding a detector", dropped into methods/ of a copy of the
    code as written, is a method everywhere: grid.detectors accepts it, its params section validates
    (an unknown key in it is refused), it builds, the report names it, and the code stage writes
    its own digest with its file (and no other method's digest holds it)."""
    copy = copy_of_the_code(tmp_path)
    example = doc_blocks("docs/detectors.md", "Adding a detector")["python"][0]
    (copy / "halludetect" / "methods" / "wide_max.py").write_text(example)
    got = run_in_copy(copy, CHECK)
    assert got["shape"] == [2] and got["dim"] == 4 and not got["sp"]
    assert got["name"] == "Wide max pooling" and got["train_runs_it"]
    assert got["own_digest"] and not got["others_digest"]  # its train stage's digest, no other method's
    assert "detectors.wide_max.dimm: unknown key; did you mean 'dim'?" in got["refused"]


def test_method_files_import_no_torch():
    """config.py (and so every stage) imports methods/: its files must not load torch, or the
    report and label stages would (tests/test_pipeline_contract.py checks those stages too)."""
    code = "import sys, halludetect.methods, halludetect.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""A bundle copied out of its repository (issue 52, item 5): its base model is a path relative to the
repository it was exported from, so the scorer says which model it names and what to pass (`--model`),
before anything loads; with `--model` it scores."""

import copy
import os

import pytest

from halludetect.scoring.bundle import load_bundle
from halludetect.scoring.scorer import Scorer


@pytest.mark.hostile
def test_a_bundle_whose_relative_model_path_is_not_here_says_to_pass_model(bundle_path, tiny_model_dir, tmp_path):
    b = load_bundle(bundle_path)
    moved = copy.copy(b)
    moved.meta = copy.deepcopy(b.meta)
    moved.meta["base_model"]["preset"]["path"] = "data/world/model"  # as the DAG's bundles name theirs
    here = os.getcwd()
    os.chdir(tmp_path)  # a folder the bundle was copied to: no data/world/model under it
    try:
        with pytest.raises(Exception, match=r"data/world/model does not exist .*pass --model DIR"):
            Scorer(moved, None, device="cpu")
        assert Scorer(moved, str(tiny_model_dir), device="cpu").preset.path == str(tiny_model_dir)
    finally:
        os.chdir(here)

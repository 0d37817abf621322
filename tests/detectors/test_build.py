"""Building, saving and loading detectors (halludetect/detectors/build.py): unknown methods suggest the
closest, a saved detector round-trips with stable bytes; and the hostile cases, a garbage,
truncated or empty detector file named with its fix (as evaluate loads it)."""

from pathlib import Path

import pytest
import torch
from support import D

from halludetect.activations.bags import Bags
from halludetect.detectors.build import build_detector, params_for
from halludetect.detectors.data import DataError
from halludetect.methods.pooling import PoolingParams


def test_unknown_method_suggests_the_closest():
    with pytest.raises(KeyError, match="did you mean 'max'"):
        build_detector("maxx", D, params_for("max"))
    with pytest.raises(KeyError, match="did you mean 'hami_sp'"):
        params_for("hami-sp")


def test_saved_detector_round_trips_with_stable_bytes(tmp_path):
    import hashlib

    from halludetect.detectors.build import build_detector, load_detector, save_detector

    params = PoolingParams(dim=4)
    torch.manual_seed(0)
    model = build_detector("max", D, params).eval()
    meta = {"method": "max", "layer": 3, "seed": 0, "best_epoch": 7, "d": D, "params": params.model_dump()}
    digests = set()
    for i in range(5):  # safetensors writes a multi-key metadata map in a different order each time
        save_detector(tmp_path / f"{i}.safetensors", model.state_dict(), meta)
        digests.add(hashlib.sha256((tmp_path / f"{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1
    loaded, got = load_detector(tmp_path / "0.safetensors")
    assert got == meta
    bags = Bags(torch.randn(12, D), torch.tensor([5, 1, 6]))
    with torch.no_grad():
        torch.testing.assert_close(loaded(bags), model(bags))


# ------------------------------------------------------------ damaged detector files (hostile)
def detector_error(root: Path) -> str:
    from halludetect.evaluation.evaluate import load_models

    with pytest.raises(DataError) as e:
        load_models(root / "dets" / "layer_1", "max", 1, [0], D)
    return str(e.value)


@pytest.mark.hostile
def test_evaluate_names_a_garbage_detector_file(trained):
    path = trained / "dets" / "layer_1" / "seed_0.safetensors"
    path.write_bytes(b"garbage" * 100)
    assert detector_error(trained).startswith(
        f"{path}: not a readable detector file (safetensors) (SafetensorError: "
        "Error while deserializing header: header too large); it is damaged "
        "or not what the train stage writes: re-run train"
    )


@pytest.mark.hostile
def test_evaluate_names_a_truncated_detector_file(trained):
    path = trained / "dets" / "layer_1" / "seed_0.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    assert detector_error(trained).startswith(
        f"{path}: not a readable detector file (safetensors) (SafetensorError: "
        "Error while deserializing header: incomplete metadata"
    )


@pytest.mark.hostile
def test_evaluate_names_an_empty_detector_file(trained):
    path = trained / "dets" / "layer_1" / "seed_0.safetensors"
    path.write_bytes(b"")
    assert detector_error(trained).startswith(
        f"{path}: not a readable detector file (safetensors) (SafetensorError: "
        "Error while deserializing header: header too small)"
    )

"""Reading layer files (halludetect/activations/layer_reader.py): padded batches and scattered bags
stream as the whole file reads; and the hostile cases, a truncated, empty, garbage or inconsistent
file (offsets past the end of states) named with its fix before any training."""

import h5py
import numpy as np
import pytest
import torch
import yaml
from support import ROOT, cell, random_bags, train_stage

from halludetect.activations.bags import pad_bags
from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import LayerReader, read_layer
from halludetect.activations.layer_writer import LayerWriter
from halludetect.detectors.data import DataError


def test_layer_reader_streams_padded_batches(tmp_path):
    states, lengths = random_bags(np.random.default_rng(1), n=11, d=8)
    w = LayerWriter(tmp_path / "l.h5", 8, "float32", {})
    w.append(states, lengths, [f"q/{i}" for i in range(11)])
    w.close()
    full = read_layer(tmp_path / "l.h5")
    with LayerReader(tmp_path / "l.h5") as reader:
        assert len(reader) == 11 and reader.response_ids == full.response_ids
        seen = []
        for index, x, mask in reader.batches(4):
            want_x, want_mask = pad_bags(full.states, full.offsets, index)
            torch.testing.assert_close(x, want_x)
            assert torch.equal(mask, want_mask) and x.shape[1] == lengths[index].max()
            seen += index.tolist()
        assert seen == list(range(11))
        for scattered in ([10, 0, 5], [3, 4, 2]):  # far apart (one read per bag) and nearby (one read)
            x, mask = reader.bags(np.array(scattered))
            want_x, want_mask = pad_bags(full.states, full.offsets, np.array(scattered))
            torch.testing.assert_close(x, want_x)
            assert torch.equal(mask, want_mask)


# ------------------------------------------------------------- damaged layer files (hostile)
def layer_error(tmp_path, damage) -> str:
    """What train (and evaluate) say, before any training, about layer 1 damaged by `damage`."""
    from halludetect.activations.layer_reader import read_layer

    acts, _, _ = cell(tmp_path)
    damage(acts / layer_filename(1))
    with pytest.raises(DataError) as e:
        read_layer(acts / layer_filename(1), expect_layer=1)
    return str(e.value)


@pytest.mark.hostile
def test_train_names_a_truncated_layer_file_and_the_fix(tmp_path):
    def truncate(path):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    msg = layer_error(tmp_path, truncate)
    assert msg.startswith(
        f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (OSError: Unable to "
        "synchronously open file (truncated file"
    )
    assert msg.endswith("re-run dump to rewrite it (dvc repro --force the dump stage)")


@pytest.mark.hostile
def test_train_names_an_empty_layer_file(tmp_path):
    msg = layer_error(tmp_path, lambda path: path.write_bytes(b""))
    assert msg.startswith(f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (OSError: ")


@pytest.mark.hostile
def test_train_names_a_garbage_layer_file(tmp_path):
    msg = layer_error(tmp_path, lambda path: path.write_bytes(b"not hdf5 at all\n" * 100))
    assert msg.startswith(
        f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (OSError: Unable to "
        "synchronously open file (file signature not found)); it is damaged or not what the dump "
        "stage writes: re-run dump"
    )


@pytest.mark.hostile
@pytest.mark.hostile
def test_a_layer_that_fails_beside_others_stops_the_stage_naming_its_file(tmp_path):
    """Every grid layer at once (this process and a spawned worker: the failing layer may be either's):
    the one damaged file stops the stage with its message, no traceback."""
    layers = tuple(yaml.safe_load((ROOT / "params.yaml").read_text())["grid"]["layers"])
    acts, labels, params = cell(tmp_path, layers=layers)
    labels.write_parquet(tmp_path / "judgments.parquet")
    _overrun(acts / layer_filename(layers[-1]))
    res = train_stage(tmp_path, acts, tmp_path / "judgments.parquet", params, layer=None, processes=2)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"{acts / layer_filename(layers[-1])}: not a readable HDF5 layer file" in res.stderr


def _overrun(path):
    """Offsets past the end of the states: the file opens, its reading fails."""
    with h5py.File(path, "r") as f:
        states, offsets, ids, attrs = f["states"][:], f["offsets"][:], f["response_id"][:], dict(f.attrs)
    offsets[-1] += 7
    with h5py.File(path, "w") as f:
        f["states"], f["offsets"], f["response_id"] = states, offsets, ids
        f.attrs.update(attrs)


def test_train_rejects_offsets_past_the_end_of_states_before_any_training(tmp_path):
    acts, labels, params = cell(tmp_path)
    labels.write_parquet(tmp_path / "judgments.parquet")
    _overrun(acts / layer_filename(1))
    res = train_stage(tmp_path, acts, tmp_path / "judgments.parquet", params)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (the last offset is 745 but "
        "states has 738 rows (offsets past the end of states))"
    ) in res.stderr
    assert "best epoch" not in res.stderr and not (tmp_path / "dets").exists()  # nothing trained, nothing written

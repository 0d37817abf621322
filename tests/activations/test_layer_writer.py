"""Writing layer files (halludetect/activations/layer_writer.py): the bytes of a file do not depend on
how its bags were appended, so DVC sees an unchanged layer as unchanged, and it reads back as written."""

import numpy as np
from support import random_bags, sha

from halludetect.activations.layer_reader import read_layer
from halludetect.activations.layer_writer import LayerWriter


def test_layer_file_bytes_do_not_depend_on_how_bags_were_appended(tmp_path):
    states, lengths = random_bags(np.random.default_rng(0))  # ~14k rows: more than one HDF5 chunk
    ids = [f"q/{i}" for i in range(len(lengths))]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for name, step in (("one", len(lengths)), ("many", 3), ("each", 1)):
        w = LayerWriter(tmp_path / f"{name}.h5", 64, "float16", {"b": 1, "a": "x"})
        for a in range(0, len(lengths), step):
            b = min(a + step, len(lengths))
            w.append(states[offsets[a] : offsets[b]], lengths[a:b], ids[a:b])
        w.close()
    assert sha(tmp_path / "one.h5") == sha(tmp_path / "many.h5") == sha(tmp_path / "each.h5")
    layer = read_layer(tmp_path / "one.h5")
    np.testing.assert_array_equal(layer.offsets, offsets)
    np.testing.assert_allclose(layer.states, states.astype(np.float16).astype(np.float32))

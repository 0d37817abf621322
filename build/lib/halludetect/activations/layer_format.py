"""The per-layer HDF5 file format, shared by its writer (`layer_writer.py`, used by dump) and its
readers (`layer_reader.py`, used by train and evaluate).

One file per layer, `layer_<L>.h5` (so a colleague can `dvc pull` one layer):

    states      float16 [total_tokens, d]   bags concatenated in response order
    offsets     int64   [n_responses + 1]   bag r is states[offsets[r]:offsets[r+1]]
    response_id string  [n_responses]       "<question_id>/<sample_index>"
    attrs: model, revision, layer, positions, dtype, prompt_hash, excluded_empty_answers

Layer 0 is the embedding output, layer i the output of decoder block i (transformers'
`output_hidden_states` numbering).
"""

from __future__ import annotations

from pathlib import Path


def layer_filename(layer: int) -> str:
    """`layer_<L>.h5`, unpadded: dvc.yaml builds the same name from a layer index (`layer_${item.layer}.h5`)."""
    return f"layer_{layer}.h5"


def layer_files(directory: str | Path) -> dict[int, Path]:
    """The layer files of a dump directory, by layer index, in order."""
    files = {int(p.stem.split("_")[1]): p for p in Path(directory).glob("layer_*.h5")}
    if not files:
        raise FileNotFoundError(f"no layer_*.h5 files in {directory}; run the dump stage first")
    return dict(sorted(files.items()))


def decode_ids(ids) -> list[str]:
    """Response ids as stored by h5py (bytes or str) -> str."""
    return [x.decode() if isinstance(x, bytes) else x for x in ids]

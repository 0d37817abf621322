"""Early exit (halludetect/activations/early_exit.py): the states of blocks 1..L equal the dump's to the
bit, from a model loaded with only those blocks and from the whole model, and nothing above block L
is loaded or run."""

import numpy as np
import polars as pl
import pytest
import torch

from halludetect.activations.capture import bag_positions, bag_slice, dump
from halludetect.activations.early_exit import load_until, states_until
from halludetect.activations.layer_reader import read_layer
from halludetect.config import ModelPreset
from halludetect.lm.model_inputs import encode_prompt, pad_ids


@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_early_exit_states_equal_the_dump_bit_for_bit(tiny, tiny_model_dir, contract, tmp_path, positions):
    """Same batches as the dump (order, size, right padding): the states of blocks 1..L are the
    dump's to the bit, from a model loaded with only those blocks and from the whole model."""
    model, tok = tiny
    qs = pl.read_parquet(contract / "questions.parquet")
    gens = pl.read_parquet(contract / "generations.parquet").sort("question_id", "sample_index")
    dump(
        model,
        tok,
        qs,
        gens,
        tmp_path,
        [0, 1, 3],
        positions=positions,
        dtype="float32",
        batch_size=16,
        attrs={},
        log=lambda *_: None,
    )
    prompts = {q: encode_prompt(tok, text, False) for q, text in qs.select("id", "question").iter_rows()}
    preset = ModelPreset(path=str(tiny_model_dir), dtype="float32")
    for layer in (0, 1, 3):
        want = read_layer(tmp_path / f"layer_{layer}.h5").states
        for m in (load_until(preset, layer, "cpu"), model):
            got = []
            for a in range(0, gens.height, 16):
                batch = gens.slice(a, 16).to_dicts()
                seqs = [prompts[r["question_id"]] + r["token_ids"] for r in batch]
                starts = [bag_slice(len(prompts[r["question_id"]]), r["n_tokens"], positions).start for r in batch]
                ids, mask = pad_ids(seqs, tok.pad_token_id, left=False)
                h = states_until(m, layer, 3, ids, mask)
                row, col = bag_positions(starts, [r["n_tokens"] for r in batch])
                got.append(h[row, col].numpy())
            assert np.array_equal(np.concatenate(got), want), (layer, type(m).__name__)


def test_early_exit_neither_loads_nor_runs_the_blocks_above(tiny, tiny_model_dir):
    model, _ = tiny
    cut = load_until(ModelPreset(path=str(tiny_model_dir), dtype="float32"), 1, "cpu")
    assert len(cut.layers) == 1 and not hasattr(cut, "lm_head")
    kept = model.model.embed_tokens.weight.numel() + sum(p.numel() for p in model.model.layers[0].parameters())
    assert sum(p.numel() for p in cut.parameters()) == kept + model.model.norm.weight.numel()
    calls = []
    above = [*model.model.layers[1:], model.model.norm, model.lm_head]
    handles = [m.register_forward_hook(lambda *_, i=i: calls.append(i)) for i, m in enumerate(above)]
    first = model.model.layers[0].register_forward_hook(lambda *_: calls.append("block 1"))
    try:
        ids = torch.randint(3, 100, (2, 7))
        states_until(model, 1, 3, ids, torch.ones_like(ids))
    finally:
        for h in [*handles, first]:
            h.remove()
    assert calls == ["block 1"]  # the whole model given: still nothing above block 1 runs

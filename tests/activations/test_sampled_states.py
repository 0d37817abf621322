"""States recorded while the model samples (halludetect/activations/sampled_states.py): one forward per
token, and the bags equal the dump's teacher-forced ones, a cut `generated` bag included."""

import numpy as np
import polars as pl
import pytest
import torch

from halludetect.activations.capture import dump
from halludetect.activations.layer_format import layer_files
from halludetect.activations.layer_reader import read_layer
from halludetect.activations.sampled_states import sample_with_states
from halludetect.config import GenerateParams
from halludetect.lm.hf_models import eos_ids
from halludetect.lm.model_inputs import encode_prompt


@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_states_of_the_sampling_pass_equal_the_teacher_forced_ones(tiny, tmp_path, positions):
    """max_new_tokens 5 cuts most answers: the `generated` bag then needs the last token's state,
    computed by one decode step on the sampling pass's cache."""
    model, tok = tiny
    qs = pl.DataFrame(
        {"id": [f"q{i}" for i in range(6)], "question": [f"Where was Tavo Mir{i} born?" for i in range(6)]}
    )
    prompts = [encode_prompt(tok, q, False) for q in qs["question"]]
    params = GenerateParams(max_new_tokens=5, stop=[])
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        sampled = sample_with_states(
            model,
            tok,
            prompts,
            [(0, q, 0, 0) for q in qs["id"]],
            params,
            eos_ids(model, tok),
            layer=2,
            positions=positions,
            states_dtype=torch.float32,
        )
    finally:
        hook.remove()
    answers = [s.answer.token_ids for s in sampled]
    assert all(answers) and any(len(a) == 5 for a in answers)
    # one forward per sampled token (prefill, then decode steps), one more only for a cut `generated` bag
    assert len(forwards) == max(map(len, answers)) + (positions == "generated")
    gens = pl.DataFrame(
        {"question_id": qs["id"], "sample_index": [0] * 6, "token_ids": answers, "n_tokens": [len(a) for a in answers]}
    )
    dump(
        model,
        tok,
        qs,
        gens,
        tmp_path,
        [2],
        positions=positions,
        dtype="float32",
        batch_size=4,
        attrs={},
        log=lambda *_: None,
    )
    layer = read_layer(layer_files(tmp_path)[2])
    for i, s in enumerate(sampled):
        np.testing.assert_allclose(s.states.numpy(), layer.states[layer.offsets[i] : layer.offsets[i + 1]], atol=1e-4)

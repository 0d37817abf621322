"""Generation, token bookkeeping, capture and the HDF5 store, on a tiny local Llama."""

import hashlib

import numpy as np
import polars as pl
import pytest
import torch

from halludetect.activations import bag_slice, capture, dump, layer_files, read_layer
from halludetect.config import GenerateParams, ModelPreset
from halludetect.generation import encode_prompt, generate, trim_answer
from halludetect.modeling import ModelError, check_layers, load_config, load_model


def questions(n=4):
    return pl.DataFrame({
        "id": [f"q{i}" for i in range(n)],
        "question": [f"Where was Tavo Mir{i} born?" for i in range(n)],
        "split": ["train", "val", "test", "test"][:n],
    })


def test_generate_bookkeeping(tiny):
    model, tok = tiny
    params = GenerateParams(n_samples=3, max_new_tokens=8, batch_size=3, stop=["\n"])
    df = generate(model, tok, questions(), params)
    assert df.height == 12
    for r in df.to_dicts():
        assert len(r["token_ids"]) == len(r["token_logprobs"]) == r["n_tokens"]
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True).strip()
        assert tok.eos_token_id not in r["token_ids"] and "\n" not in r["text"]
        assert all(lp <= 0 for lp in r["token_logprobs"])
    again = generate(model, tok, questions(), params)
    assert again["text"].to_list() == df["text"].to_list()  # same params, same samples


def test_logprobs_are_raw_model_logprobs(tiny):
    model, tok = tiny
    df = generate(model, tok, questions(1), GenerateParams(n_samples=1, max_new_tokens=5, stop=[]), greedy=True)
    r = df.row(0, named=True)
    prompt = encode_prompt(tok, "Where was Tavo Mir0 born?", False)
    ids = torch.tensor([prompt + r["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r["token_ids"])]
    np.testing.assert_allclose(r["token_logprobs"], want, atol=1e-4)


def test_trim_answer_stop_and_eos(tiny):
    _, tok = tiny
    text_ids = tok.encode(" born in Arvella.\nQuestion: next", add_special_tokens=False)
    t = trim_answer(tok, text_ids, ["\n", "Question:"], 64)
    assert t.finish_reason == "stop" and "\n" not in t.text and t.text.startswith("born in")
    assert tok.decode(t.token_ids).strip() == t.text
    eos = trim_answer(tok, [*tok.encode(" yes", add_special_tokens=False), tok.eos_token_id, 5], [], 64)
    assert eos.finish_reason == "eos" and eos.text == "yes"


def test_bag_slices():
    # prompt of 5 tokens, answer of 3: predicting = positions 4, 5, 6; generated = 5, 6, 7
    assert bag_slice(5, 3, "predicting") == slice(4, 7)
    assert bag_slice(5, 3, "generated") == slice(5, 8)
    with pytest.raises(ValueError, match="choose from"):
        bag_slice(5, 3, "middle")


def test_capture_equals_output_hidden_states_and_removes_hooks(tiny):
    model, _ = tiny
    hooks = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    ids = torch.randint(3, 100, (2, 9))
    layers = [0, 1, 3]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
        before = hooks()  # transformers adds capture hooks of its own on first use
        with capture(model, layers) as store:
            model(ids)
    for layer in layers:
        torch.testing.assert_close(store[layer], ref[layer])
    assert hooks() == before
    with pytest.raises(RuntimeError), capture(model, [1]):
        assert hooks() == before + 1
        raise RuntimeError("boom")
    assert hooks() == before  # removed on error too


def test_layer_check_before_weights(tiny_model_dir):
    config = load_config(ModelPreset(path=str(tiny_model_dir)))
    assert check_layers("all", config) == [0, 1, 2, 3]
    with pytest.raises(ModelError, match=r"\[7\] out of range: this model has layers 0..3"):
        check_layers([1, 7], config)


def test_missing_model_and_4bit_without_cuda(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_config(ModelPreset(path=str(tmp_path / "nope")))
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="needs a CUDA GPU"):
            load_model(ModelPreset(path=str(tmp_path), quantization="4bit"))


@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_dump_states_match_sampling_time_states(tiny, tmp_path, positions):
    model, tok = tiny
    qs = questions()
    gens = generate(model, tok, qs, GenerateParams(n_samples=2, max_new_tokens=6, stop=[]))
    gens = gens.filter(pl.col("n_tokens") > 0)
    out = tmp_path / positions
    out.mkdir()
    dump(model, tok, qs, gens, out, [0, 2, 3], positions=positions, dtype="float32", batch_size=3,
         attrs={"model": "tiny"}, log=lambda *_: None)
    files = layer_files(out)
    assert list(files) == [0, 2, 3]
    layer = read_layer(files[2])
    assert layer.attrs["layer"] == 2 and len(layer.response_ids) == gens.height
    # Each bag equals an unpadded, unbatched forward pass over prompt + answer.
    for k, r in enumerate(gens.sort("question_id", "sample_index").to_dicts()):
        prompt = encode_prompt(tok, qs.filter(pl.col("id") == r["question_id"])["question"][0], False)
        with torch.no_grad():
            h = model(torch.tensor([prompt + r["token_ids"]]), output_hidden_states=True).hidden_states[2][0]
        want = h[bag_slice(len(prompt), r["n_tokens"], positions)].numpy()
        got = layer.states[layer.offsets[k] : layer.offsets[k + 1]]
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert layer.response_ids[k] == f"{r['question_id']}/{r['sample_index']}"


def test_hdf5_bytes_are_deterministic(tiny, tmp_path):
    model, tok = tiny
    qs = questions(2)
    gens = generate(model, tok, qs, GenerateParams(n_samples=2, max_new_tokens=4, stop=[]))
    gens = gens.filter(pl.col("n_tokens") > 0)
    digests = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        dump(model, tok, qs, gens, tmp_path / name, [1], positions="predicting", dtype="float16", batch_size=2,
             attrs={"model": "tiny"}, log=lambda *_: None)
        digests.append(hashlib.sha256((tmp_path / name / "layer_01.h5").read_bytes()).hexdigest())
    assert digests[0] == digests[1]

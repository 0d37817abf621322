"""Capture and the dump (halludetect/activations/capture.py) on a tiny local Llama: the hooks return
what `output_hidden_states` does and leave nothing behind; the teacher-forced dump writes each answer's
bag as an unbatched forward pass computes it (and as the sampling pass saw it), in byte-stable layer
files, the same bytes sharded over processes or with the model placed by `device_map`, and nothing
at all when it is interrupted."""

import hashlib

import numpy as np
import polars as pl
import pytest
import torch
from support import sha

from halludetect.activations.capture import bag_slice, capture, dump
from halludetect.activations.layer_format import layer_files
from halludetect.activations.layer_reader import read_layer
from halludetect.activations.layer_writer import merge_parts
from halludetect.config import GenerateParams, ModelPreset
from halludetect.core.atomic_io import atomic_path
from halludetect.lm.generation import generate, trim_answer
from halludetect.lm.hf_models import load_model
from halludetect.lm.model_inputs import encode_prompt
from halludetect.lm.parallel import Workers


def questions(n=4):
    return pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was Tavo Mir{i} born?" for i in range(n)],
            "split": ["train", "val", "test", "test"][:n],
        }
    )


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


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_the_top_layer_is_the_final_norm_found_from_the_architecture(arch):
    """The top hidden state carries the final norm whatever it is called and wherever it is
    registered (GPT-2's transformer.ln_f, OPT's decoder.final_layer_norm before its blocks,
    Llama's model.norm): found by what the model computes, not by an attribute named `norm`."""
    import transformers

    torch.manual_seed(0)
    config, cls = {
        "gpt2": (dict(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32), "GPT2"),
        "opt": (
            dict(
                num_hidden_layers=2,
                hidden_size=16,
                ffn_dim=32,
                num_attention_heads=2,
                vocab_size=50,
                max_position_embeddings=32,
                word_embed_proj_dim=16,
            ),
            "OPT",
        ),
        "llama": (
            dict(
                num_hidden_layers=2,
                hidden_size=16,
                intermediate_size=32,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=50,
            ),
            "Llama",
        ),
    }[arch]
    model_cls = getattr(transformers, f"{cls}ForCausalLM" if arch != "gpt2" else "GPT2LMHeadModel")
    conf = getattr(transformers, f"{cls}Config")(**config, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = model_cls(conf).eval()
    ids = torch.randint(3, 40, (2, 6))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
        with capture(model, [1, 2]) as store:
            model(ids)
    torch.testing.assert_close(store[1], ref[1])
    torch.testing.assert_close(store[2], ref[2])  # block 2 + the final norm
    assert not torch.allclose(ref[2], store[1])


@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_dump_equals_unbatched_forward(tiny, tmp_path, positions):
    model, tok = tiny
    qs = questions()
    gens = generate(model, tok, qs, GenerateParams(n_samples=2, max_new_tokens=6, stop=[]))
    gens = gens.filter(pl.col("n_tokens") > 0)
    out = tmp_path / positions
    out.mkdir()
    dump(
        model,
        tok,
        qs,
        gens,
        out,
        [0, 2, 3],
        positions=positions,
        dtype="float32",
        batch_size=3,
        attrs={"model": "tiny"},
        log=lambda *_: None,
    )
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
        dump(
            model,
            tok,
            qs,
            gens,
            tmp_path / name,
            [1],
            positions="predicting",
            dtype="float16",
            batch_size=2,
            attrs={"model": "tiny"},
            log=lambda *_: None,
        )
        digests.append(hashlib.sha256((tmp_path / name / "layer_1.h5").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_sampling_time_states_equal_teacher_forced_states(tiny, tmp_path, positions):
    """The states `generate(output_hidden_states=True)` sees (left-padded, KV cache, one step at
    a time) equal the dump's (right-padded, one full pass) within 1e-4 in float32."""
    model, tok = tiny
    qs = questions(3)
    prompts = [encode_prompt(tok, q, False) for q in qs["question"]]
    width = max(map(len, prompts))
    ids = torch.full((3, width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=6,
            output_hidden_states=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
        )
    answers = [trim_answer(tok, row.tolist(), [], 6).token_ids for row in out.sequences[:, width:]]
    assert all(answers)
    gens = pl.DataFrame(
        {
            "question_id": qs["id"],
            "sample_index": [0, 0, 0],
            "token_ids": answers,
            "n_tokens": [len(a) for a in answers],
        }
    )
    dump(
        model,
        tok,
        qs,
        gens,
        tmp_path,
        [0, 2, 3],
        positions=positions,
        dtype="float32",
        batch_size=2,
        attrs={},
        log=lambda *_: None,
    )
    steps = out.hidden_states  # steps[t][layer]: [rows, seq, d]; step t's last position predicts token t
    for layer in (0, 2, 3):
        got = read_layer(tmp_path / f"layer_{layer}.h5")
        for i, a in enumerate(answers):
            bag = got.states[got.offsets[i] : got.offsets[i + 1]]
            if positions == "predicting":
                want = [steps[t][layer][i, -1] for t in range(len(a))]
            else:  # token t's own state is computed at step t + 1; the last token's only if generation went on
                want = [steps[t + 1][layer][i, -1] for t in range(min(len(a), len(steps) - 1))]
                bag = bag[: len(want)]
            np.testing.assert_allclose(bag, torch.stack(want).numpy(), atol=1e-4)


def test_dump_shards_merge_to_the_one_process_bytes(tiny, tmp_path):
    model, tok = tiny
    qs = questions()
    gens = generate(model, tok, qs, GenerateParams(n_samples=3, max_new_tokens=5, stop=[]))
    gens = gens.filter(pl.col("n_tokens") > 0)
    kw = dict(positions="predicting", dtype="float16", batch_size=2, attrs={"model": "tiny"}, log=lambda *_: None)
    for name, workers in (("single", None), ("rank0", Workers(0, 2)), ("rank1", Workers(1, 2))):
        (tmp_path / name).mkdir()
        dump(model, tok, qs, gens, tmp_path / name, [1, 3], workers=workers, **kw)
    assert len(read_layer(tmp_path / "rank0" / "layer_1.h5").response_ids) == 6  # 3 of 5 batches
    (tmp_path / "merged").mkdir()
    merge_parts([tmp_path / "rank0", tmp_path / "rank1"], tmp_path / "merged", [1, 3], block_rows=7)
    for f in ("layer_1.h5", "layer_3.h5"):
        assert sha(tmp_path / "merged" / f) == sha(tmp_path / "single" / f)


def test_interrupted_dump_leaves_no_output(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    qs = questions()
    gens = generate(model, tok, qs, GenerateParams(n_samples=2, max_new_tokens=4, stop=[]))
    calls = []
    real_forward = model.forward

    def dies(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_forward(*a, **k)

    monkeypatch.setattr(model, "forward", dies)
    with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / "acts", is_dir=True) as tmp:
        dump(
            model,
            tok,
            qs,
            gens.filter(pl.col("n_tokens") > 0),
            tmp,
            [1],
            positions="predicting",
            dtype="float16",
            batch_size=2,
            attrs={},
            log=lambda *_: None,
        )
    assert list(tmp_path.iterdir()) == []  # no output, no temporary left behind


def test_device_map_preset_generates_and_dumps_like_the_plain_model(tiny, tiny_model_dir, tmp_path):
    """`device_map: auto` goes through accelerate's placement (all on the CPU here, split over
    GPUs on a real machine); sampling and capture must not notice."""
    model, tok = tiny
    placed = load_model(ModelPreset(path=str(tiny_model_dir), dtype="float32", device_map="auto"))
    qs = questions(3)
    params = GenerateParams(n_samples=2, max_new_tokens=5, stop=[])
    gens = generate(model, tok, qs, params)
    assert generate(placed, tok, qs, params).drop("seconds").equals(gens.drop("seconds"))
    gens = gens.filter(pl.col("n_tokens") > 0)
    for name, m in (("plain", model), ("placed", placed)):
        (tmp_path / name).mkdir()
        dump(
            m,
            tok,
            qs,
            gens,
            tmp_path / name,
            [0, 3],
            positions="predicting",
            dtype="float16",
            batch_size=4,
            attrs={},
            log=lambda *_: None,
        )
    for f in ("layer_0.h5", "layer_3.h5"):
        assert sha(tmp_path / "plain" / f) == sha(tmp_path / "placed" / f)

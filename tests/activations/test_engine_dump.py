"""States from the engine (`dump.source: engine`; lm/engine_states.py, activations/engine_dump.py):
sampled through the fake vLLM engine with hidden-state extraction (vLLM's file format, written after
the reply under its flock, from the tiny model's own forward pass), the layer files equal the hf
dump's of the same answers to float tolerance, every layer and both position conventions, the
top layer through the local final norm and the log-prob check from the top state; and what cannot
be matched is refused naming why: a server without extraction, one that saves the prompt's states
only, other layer ids than params say, a file the stage cannot read, a 'generated' bag whose last
state no pass computed, states of another run's answers, layers the server does not extract, a
served model that is not the preset's."""

from __future__ import annotations

import h5py
import numpy as np
import polars as pl
import pytest

from halludetect.activations.capture import dump
from halludetect.activations.engine_dump import FinalHead, check_engine_layers, dump_engine
from halludetect.activations.layer_format import decode_ids, layer_filename
from halludetect.activations.logprob_check import LogprobCheck, LogprobMismatch
from halludetect.config import GenerateParams, ModelPreset
from halludetect.core.endpoint import ApiError
from halludetect.lm.completions import generate_completions
from halludetect.lm.engine_states import AnswerStates, StatesProblem
from halludetect.lm.hf_models import load_config, load_generation_eos, load_tokenizer
from halludetect.qa.responses import select_answers
from halludetect.testing.fake_vllm import FakeVLLM

LAYERS = [0, 1, 2, 3]  # the tiny model's: embeddings, blocks 1 and 2, the top (block 3 through the final norm)


def questions(n=6):
    return pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was Tavo Mir{'a' * i} born?" for i in range(n)],
            "split": ["train", "val", "test"] * (n // 3),
        }
    )


def params(url, hidden_states=LAYERS, **kw) -> GenerateParams:
    endpoint = {"base_url": url, "concurrency": 4, "max_retries": 0, "timeout": 30, "per_request": "answer"}
    base = dict(n_samples=2, max_new_tokens=6, stop=["\n"], batch_size=2, temperature=1.0, backend="completions")
    return GenerateParams(**(base | kw), endpoint=endpoint | {"hidden_states": hidden_states})


def sample_with_states(model_dir, p: GenerateParams, states_dir):
    preset = ModelPreset(path=str(model_dir), dtype="float32")
    tok, config = load_tokenizer(preset), load_config(preset)
    eos = load_generation_eos(preset, config)
    df, _ = generate_completions(tok, config, questions(), p, model=str(model_dir), eos=eos, states_dir=states_dir)
    return df


@pytest.fixture(scope="module")
def sampled(tiny_model_dir, tmp_path_factory):
    """Answers sampled through an engine extracting the tiny model's every layer, with their kept states."""
    tmp = tmp_path_factory.mktemp("engine")
    assert load_config(ModelPreset(path=str(tiny_model_dir))).num_hidden_layers == LAYERS[-1]
    with FakeVLLM(tiny_model_dir, hidden_states=LAYERS, states_dir=tmp / "shm", states_delay=0.05) as srv:
        df = sample_with_states(tiny_model_dir, params(srv.url, max_new_tokens=20), tmp / "gen.states")
    assert not list((tmp / "shm").glob("*")), "the engine's files (and locks) are removed once read"
    return df, tmp / "gen.states"


def layer_arrays(out_dir, layer):
    with h5py.File(out_dir / layer_filename(layer), "r") as f:
        return f["states"][:].astype(np.float32), f["offsets"][:], decode_ids(f["response_id"][:])


def engine_dump(sampled_df, states_dir, out, positions, tiny_model_dir, check=True, layers=LAYERS):
    selected, _ = select_answers(sampled_df)
    out.mkdir()
    head = FinalHead(ModelPreset(path=str(tiny_model_dir), dtype="float32"))
    lp = LogprobCheck("models.tiny", 0.05, 0.5, 0.01) if check else None
    logged = []
    dump_engine(
        selected,
        AnswerStates(states_dir, LAYERS),
        out,
        layers,
        top=LAYERS[-1],
        hidden=head.norm_module.weight.shape[0],
        positions=positions,
        dtype="float32",
        batch_size=4,
        attrs={"positions": positions},
        head=head,
        check=lp,
        log=logged.append,
    )
    return selected, logged


@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_engine_states_give_the_hf_dump(sampled, tiny, tiny_model_dir, tmp_path, positions):
    df, states_dir = sampled
    if positions == "generated":  # answers cut at max_new_tokens have no last state: left to the next test
        df = df.filter(pl.col("finish_reason") != "length")
        assert df.height, "every tiny answer ran to max_new_tokens"
    selected, logged = engine_dump(df, states_dir, tmp_path / "engine", positions, tiny_model_dir)
    assert any("log-prob check passed" in line for line in logged), logged
    model, tok = tiny
    (tmp_path / "hf").mkdir()
    dump(model, tok, questions(), selected, tmp_path / "hf", LAYERS, positions=positions, dtype="float32",
         batch_size=4, attrs={"positions": positions})  # fmt: skip
    for layer in LAYERS:
        engine, hf = layer_arrays(tmp_path / "engine", layer), layer_arrays(tmp_path / "hf", layer)
        assert engine[2] == hf[2] and (engine[1] == hf[1]).all()  # the same answers, in the same order
        np.testing.assert_allclose(engine[0], hf[0], atol=2e-5, rtol=1e-4)


def test_a_generated_bag_without_its_last_state_is_refused_naming_the_answer(sampled, tiny_model_dir, tmp_path):
    df, states_dir = sampled
    cut = df.filter(pl.col("finish_reason") == "length")
    if not cut.height:
        pytest.skip("no tiny answer ran to max_new_tokens")
    with pytest.raises(StatesProblem, match="never computed its last token's state.*dump.positions: predicting"):
        engine_dump(cut, states_dir, tmp_path / "out", "generated", tiny_model_dir, check=False)


def test_states_missing_or_of_other_tokens_are_refused(sampled, tiny_model_dir, tmp_path):
    df, states_dir = sampled
    with pytest.raises(StatesProblem, match="no engine states for answer .*dvc repro -f generate"):
        engine_dump(df, tmp_path / "elsewhere", tmp_path / "a", "predicting", tiny_model_dir)
    first = df.row(0, named=True)
    other = df.with_columns(
        pl.when(pl.col("question_id") == first["question_id"], pl.col("sample_index") == first["sample_index"])
        .then(pl.col("token_ids").list.reverse())
        .otherwise(pl.col("token_ids"))
        .alias("token_ids")
    ).filter(pl.col("n_tokens") > 1)
    if other.height == df.filter(pl.col("n_tokens") > 1).height and first["n_tokens"] > 1:
        with pytest.raises(StatesProblem, match="other tokens than the answer's"):
            engine_dump(other, states_dir, tmp_path / "b", "predicting", tiny_model_dir, check=False)


def test_layers_the_server_does_not_extract_are_refused_before_work():
    with pytest.raises(StatesProblem, match=r"layer\(s\) \[1\] are not among the server's"):
        check_engine_layers([0, 1], [0, 2], top=2, checked=True)
    with pytest.raises(StatesProblem, match="the top one"):
        check_engine_layers([0], [0, 1], top=2, checked=True)
    check_engine_layers([0], [0], top=2, checked=False)  # no check: the top layer is not needed


@pytest.mark.parametrize(
    "engine, p_layers, match",
    [
        ({"hidden_states": None}, LAYERS, "has no kv_transfer_params.hidden_states_path: the server was not started"),
        ({"hidden_states": LAYERS, "states_tokens": "prompt"}, LAYERS, "holds the prompt's states only"),
        ({"hidden_states": LAYERS}, [0, 3], "states of 4 layer"),
    ],
    ids=["no_extraction", "prompt_only", "other_layer_ids"],
)
def test_a_server_whose_states_cannot_be_used_stops_generate_naming_why(
    tiny_model_dir, tmp_path, engine, p_layers, match
):
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **engine) as srv, pytest.raises(ApiError, match=match):
        sample_with_states(tiny_model_dir, params(srv.url, hidden_states=p_layers), tmp_path / "states")


def test_a_states_file_the_stage_cannot_read_is_named(tiny_model_dir, tmp_path, monkeypatch):
    """A named file that never appears is waited for APPEAR_S (60 s: a shared filesystem's delay; here
    0.2 s), then named."""
    import halludetect.lm.engine_states as engine_states

    monkeypatch.setattr(engine_states, "APPEAR_S", 0.2)

    def elsewhere(response, body, n):
        response["kv_transfer_params"]["hidden_states_path"] = "/nonexistent/shm/cmpl-1.safetensors"
        return response

    engine = FakeVLLM(tiny_model_dir, hidden_states=LAYERS, states_dir=tmp_path / "shm", mutate=elsewhere)
    with (
        engine as srv,
        pytest.raises(ApiError, match="not readable here: generate must see the server's shared_storage"),
    ):
        sample_with_states(tiny_model_dir, params(srv.url), tmp_path / "states")


def test_the_log_prob_check_from_the_top_state_fails_for_a_served_model_with_another_head(tiny_model_dir, tmp_path):
    """The check recomputes the log-probs from the served top states through the preset's final norm and
    LM head: a served model whose head differs fails it (noise 2.0: mean |difference| 0.24 nats; at 0.5,
    0.04 passes the 0.05 tolerance). A model that differs only in its blocks passes it: docs say so."""
    with FakeVLLM(
        tiny_model_dir, hidden_states=LAYERS, states_dir=tmp_path / "shm", weight_noise=2.0
    ) as srv:  # another model: its states and log-probs, the preset's final norm and head
        df = sample_with_states(tiny_model_dir, params(srv.url), tmp_path / "states")
    with pytest.raises(LogprobMismatch, match="not those of models.tiny"):
        engine_dump(df, tmp_path / "states", tmp_path / "out", "predicting", tiny_model_dir)


def test_a_damaged_states_file_is_named_with_what_to_do(sampled, tiny_model_dir, tmp_path):
    import shutil

    df, states_dir = sampled
    copy = tmp_path / "states"
    shutil.copytree(states_dir, copy)
    first = df.row(0, named=True)
    path = AnswerStates(copy).answer_path(first["question_id"], first["sample_index"])
    path.write_bytes(path.read_bytes()[:100])  # cut, as a full disk or a kill would leave it
    with pytest.raises(StatesProblem, match=r"cannot be read .*re-run generate"):
        engine_dump(df, copy, tmp_path / "out", "predicting", tiny_model_dir)


def test_states_with_several_answers_per_request_are_refused_before_sampling(tiny_model_dir, tmp_path):
    with FakeVLLM(tiny_model_dir, hidden_states=LAYERS, states_dir=tmp_path / "shm") as srv:
        p = params(srv.url)
        p = p.model_copy(update={"endpoint": p.endpoint.model_copy(update={"per_request": "question"})})
        with pytest.raises(Exception, match="per_request: answer"):
            sample_with_states(tiny_model_dir, p, tmp_path / "states")
        assert srv.count == 0

"""States from the engine (`dump.source: engine`; lm/engine_states.py, activations/engine_dump.py):
sampled through the fake vLLM written from vLLM 0.34.0's code (halludetect/testing/fake_vllm.py: a
stop string's reply names no file, yet the file is written, running past the answer; columns in
ascending id order; a file per request, never deleted), with the default stops and layer ids listed
out of order, the layer files equal the hf dump's of the same answers to float tolerance, every
layer and both position conventions, the top layer through the local final norm and the log-prob
check from the top state, and no file of ours left in the engine's folder, time-outs included; and
what cannot be matched is refused naming why: a server without extraction, one that ignores the path
a request gives, one that saves the prompt's states only, another number of layers than params say,
a file the stage never sees, a 'generated' bag whose last state no pass computed, states of another
run's answers, layers the server does not extract, a served model that is not the preset's."""

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
from halludetect.testing.fake_vllm import FakeVLLM, Fault

LAYERS = [0, 1, 2, 3]  # the tiny model's: embeddings, blocks 1 and 2, the top (block 3 through the final norm)
UNSORTED = [3, 0, 2, 1]  # what params list; the server lists them in yet another order (vLLM sorts both)
STOPS = ["\n", "Question:", "a"]  # the defaults, and a letter the tiny model's words often hold
ENGINE = {"hidden_states": [1, 3, 0, 2], "allow_custom_save_path": True}  # a server as the docs start it


def questions(n=6):
    return pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was Tavo Mir{'a' * i} born?" for i in range(n)],
            "split": ["train", "val", "test"] * (n // 3),
        }
    )


def params(url, hidden_states=UNSORTED, endpoint=None, **kw) -> GenerateParams:
    ep = {"base_url": url, "concurrency": 4, "max_retries": 0, "timeout": 30, "per_request": "answer"}
    base = dict(n_samples=2, max_new_tokens=6, stop=STOPS, batch_size=2, temperature=1.0, backend="completions")
    return GenerateParams(**(base | kw), endpoint=ep | {"hidden_states": hidden_states} | (endpoint or {}))


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
    with FakeVLLM(tiny_model_dir, states_dir=tmp / "shm", states_delay=0.05, **ENGINE) as srv:
        df = sample_with_states(tiny_model_dir, params(srv.url, max_new_tokens=20), tmp / "gen.states")
        assert srv.stop_string_endings > 0, "no answer ended by a stop string: the case vLLM names no file for"
        srv.wait_writes()
    assert (df["finish_reason"] == "stop").any() and (df["finish_reason"] != "stop").any()
    assert not (tmp / "gen.states.engine-r0").exists(), "every file (and lock) of ours is removed, the folder too"
    assert not (tmp / "shm").exists() or not list((tmp / "shm").iterdir()), "the engine wrote nothing of ours there"
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


def test_a_generated_bag_without_its_last_state_is_refused_naming_the_answer(tiny_model_dir, tmp_path):
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **ENGINE) as srv:  # no stop: most run to length
        df = sample_with_states(tiny_model_dir, params(srv.url, stop=[], max_new_tokens=3), tmp_path / "states")
    cut = select_answers(df)[0].filter(pl.col("finish_reason") == "length")
    assert cut.height, "every tiny answer ended by EOS within 3 tokens"
    with pytest.raises(StatesProblem, match="never computed its last token's state.*dump.positions: predicting"):
        engine_dump(cut, tmp_path / "states", tmp_path / "out", "generated", tiny_model_dir, check=False)


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
        ({"hidden_states": None}, UNSORTED, "names no states file .*not started with hidden-state extraction"),
        ({"hidden_states": LAYERS}, UNSORTED, "another path than the request gave: it ignores hidden_states_path"),
        (ENGINE | {"states_tokens": "prompt"}, UNSORTED, "holds the prompt's states only"),
        (ENGINE, [0, 3], "states of 4 layer.* not 2"),
        (ENGINE | {"states_writer": lambda path, tensors: None}, UNSORTED, "generate cannot use: .*did not appear"),
    ],
    ids=["no_extraction", "no_custom_path", "prompt_only", "other_layer_count", "file_never_seen"],
)
def test_a_server_whose_states_cannot_be_used_stops_generate_naming_why(
    tiny_model_dir, tmp_path, monkeypatch, engine, p_layers, match
):
    import halludetect.lm.engine_states as engine_states

    monkeypatch.setattr(engine_states, "APPEAR_S", 0.2)  # a file that never comes: 60 s in use
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **engine) as srv, pytest.raises(ApiError, match=match):
        sample_with_states(tiny_model_dir, params(srv.url, hidden_states=p_layers), tmp_path / "states")
    assert not list(tmp_path.glob("states.engine-r0/hd-*")), "nothing of ours is left behind"


def test_requests_given_up_on_leave_no_file_of_ours(tiny_model_dir, tmp_path):
    """Two replies come past generate's time-out, their states written later still (the engine goes on
    with a request its client gave up on): each is sent again naming a fresh file (two tries sharing a
    lock would stall vLLM's worker), and the abandoned tries' files are swept before generate returns."""
    late: set[str] = set()

    def hold(body, n):
        if n in (3, 8):  # the probe is request 0
            late.add(body["kv_transfer_params"]["hidden_states_path"])
            return Fault(status=200, delay=4.0)
        return None

    def written(path):
        return 5.0 if str(path) in late else 0.0

    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", fault=hold, states_delay=written, **ENGINE) as srv:
        p = params(srv.url, endpoint={"timeout": 3.0, "max_retries": 2})
        sample_with_states(tiny_model_dir, p, tmp_path / "states")
        paths = [b["kv_transfer_params"]["hidden_states_path"] for b in srv.requests]
        assert len(set(paths)) == len(paths), "a fresh file for every try"
        assert len(late) == 2 and late <= set(paths)
    assert not (tmp_path / "states.engine-r0").exists(), "every file of ours swept, the late ones included"


def test_the_log_prob_check_from_the_top_state_fails_for_a_served_model_with_another_head(tiny_model_dir, tmp_path):
    """The check recomputes the log-probs from the served top states through the preset's final norm and
    LM head: a served model whose head differs fails it (noise 2.0: mean |difference| 0.24 nats; at 0.5,
    0.04 passes the 0.05 tolerance). A model that differs only in its blocks passes it: docs say so."""
    with FakeVLLM(
        tiny_model_dir, states_dir=tmp_path / "shm", weight_noise=2.0, **ENGINE
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
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **ENGINE) as srv:
        p = params(srv.url)
        p = p.model_copy(update={"endpoint": p.endpoint.model_copy(update={"per_request": "question"})})
        with pytest.raises(Exception, match="per_request: answer"):
            sample_with_states(tiny_model_dir, p, tmp_path / "states")
        assert srv.count == 0


def test_a_server_without_the_lock_gives_the_same_states(sampled, tiny_model_dir, tmp_path):
    """`use_synchronization_lock: false`: no lock file, the file read once it parses; the same states."""
    df, states_dir = sampled
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", use_synchronization_lock=False, **ENGINE) as srv:
        again = sample_with_states(tiny_model_dir, params(srv.url, max_new_tokens=20), tmp_path / "states")
    assert again["token_ids"].to_list() == df["token_ids"].to_list()
    for r in df.iter_rows(named=True):
        a = AnswerStates(states_dir).load(r["question_id"], r["sample_index"])
        b = AnswerStates(tmp_path / "states").load(r["question_id"], r["sample_index"])
        assert a[1] == b[1] == LAYERS and a[2] == b[2]
        np.testing.assert_allclose(a[0].numpy(), b[0].numpy(), atol=1e-6)

"""`halludetect serve --engine` in front of the fake vLLM written from vLLM 0.34.0's code
(halludetect/testing/fake_vllm.py): served scores equal `halludetect score`'s with stop strings (whose
replies name no states file) and an unsorted `--engine-layers`; a server that cannot give usable
states is refused at start naming the fix; and a hostile engine, naming paths outside the states
directory, `..`, another request's file, the repository's own outputs, or putting a symlink, FIFO,
directory or wrong states in our file's place, gets a 502 with every file outside the directory
byte-identical; after many requests, some ended by a stop string and some given up on, the
directory holds no file of ours."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from openai import OpenAI
from safetensors.torch import save_file
from serve_support import LONG, QUESTION, leave_after_first_chunk, streamed, until_not_429

from halludetect.config import GenerateParams
from halludetect.scoring.scorer import Scorer, score_answers
from halludetect.scoring.serve import EngineClient, Server, Service
from halludetect.testing.fake_vllm import FakeVLLM, Fault

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")
ENGINE_LAYERS = [3, 0, 2, 1]  # the tiny model's every layer (3 blocks), listed out of order
STOPS = ["\n", "Question:", "a"]  # the defaults, and a letter the tiny model's words often hold


def post(srv, body) -> tuple[int, dict]:
    host, port = srv.http.server_address
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def ours(directory) -> list[str]:
    """The files of ours in the states directory (its owner flock aside)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("hd-")) if directory.exists() else []


def scorer(bundle_path, tiny_model_dir, **generate) -> Scorer:
    params = GenerateParams(**({"max_new_tokens": 8, "stop": STOPS} | generate))
    return Scorer(bundle_path, str(tiny_model_dir), device="cpu", generate=params)


@pytest.fixture(scope="module")
def engine_served(bundle_path, tiny_model_dir, tmp_path_factory):
    """A faithful fake vLLM (custom paths allowed) and the server in front of it."""
    shm, states = tmp_path_factory.mktemp("shm"), tmp_path_factory.mktemp("ours") / "states"
    engine = FakeVLLM(
        tiny_model_dir, hidden_states=[1, 3, 0, 2], states_dir=shm, states_delay=0.01, allow_custom_save_path=True
    )
    with engine:
        client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=states)
        service = Service(scorer(bundle_path, tiny_model_dir), name="tiny", engine=client, log=lambda *_: None)
        with Server(service, port=0, log=lambda *_: None) as srv:
            yield srv, engine, states


def test_served_in_front_of_vllm_scores_equal_the_offline_scorer(engine_served, bundle_path, tiny_model_dir):
    srv, engine, states = engine_served
    before = engine.count
    client = OpenAI(base_url=srv.url, api_key="-", max_retries=0)
    r = client.completions.create(model="tiny", prompt=QUESTION, n=6, seed=5, max_tokens=8)
    assert engine.count - before == 6  # one request per answer, each naming its states file
    for body in engine.requests[before:]:
        path = body["kv_transfer_params"]["hidden_states_path"]
        assert body["kv_transfer_params"]["include_output_tokens"] is True
        assert os.path.dirname(path) == str(states) and re.fullmatch(r"hd-[0-9a-f]{24}\.safetensors", path[-39:])
    assert srv.service.scorer.model is None  # no model loaded here
    ended = [c.finish_reason for c in r.choices]
    rows = [{"question": QUESTION, "answer": c.text, "answer_token_ids": c.token_ids} for c in r.choices]
    scored = [(row, c.hallucination) for row, c in zip(rows, r.choices) if c.hallucination["score"] is not None]
    assert scored, "nothing scoreable"
    offline = score_answers(bundle_path, [row for row, _ in scored], model=str(tiny_model_dir), device="cpu")
    np.testing.assert_allclose([h["score"] for _, h in scored], offline["score"].to_numpy(), atol=1e-3)
    for stat in ("mean_logprob", "min_logprob"):  # the engine's raw log-probs: the teacher-forced pass's
        np.testing.assert_allclose([h[stat] for _, h in scored], offline[stat].to_numpy(), atol=1e-4)
    # the engine ended some answers by a stop string: their replies named no file, and they were scored
    assert engine.stop_string_endings > 0, ended
    engine.wait_writes()
    srv.service.engine.states.sweep()
    assert ours(states) == [], "each states file (and its lock) is deleted once scored"


# ------------------------------------------------------------------------------ streaming
def sse(response) -> list:
    """The data of each server-sent event of an http.client response, JSON-decoded but for [DONE]."""
    events, data = [], []
    for line in response.read().decode().splitlines():
        if not line:
            if data:
                events.append(data[0] if data == ["[DONE]"] else json.loads("\n".join(data)))
                data = []
        elif line.startswith("data: "):
            data.append(line[6:])
    return events


def stream_post(url_or_srv, body, route="/v1/completions"):
    """(status, headers, events) of a streamed POST to the fake (its /v1 URL) or to our server."""
    if isinstance(url_or_srv, str):
        host, port = url_or_srv.split("//")[1].split("/")[0].split(":")
    else:
        host, port = url_or_srv.http.server_address
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", route, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, sse(r)
    conn.close()
    return out


# every key of vLLM 0.34.0's chunk (CompletionStreamResponse, model_dump_json(exclude_unset=True):
# entrypoints/openai/completion/serving.py:499-536, protocol.py:725-760)
CHUNK_KEYS = {"id", "object", "created", "model", "choices", "kv_transfer_params"}
CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids",
               "weight_versions"}  # fmt: skip


@pytest.mark.parametrize("step", [1, 2], ids=["token_a_step", "two_tokens_a_step"])
def test_the_fakes_stream_is_vllms_chunks_adding_up_to_its_unstreamed_reply(step, tiny_model_dir, tmp_path):
    """The test double itself: for the same seed, the streamed chunks' texts, ids and log-probs add up to
    the unstreamed reply's; every chunk has vLLM's keys, the prompt's ids come once, the reply's
    kv_transfer_params only on the last chunk (null where a stop string ended the answer), the text
    of a step held back by the longest stop string's length less one, then usage and [DONE]."""
    options = {"hidden_states": [0, 3], "allow_custom_save_path": True, "stream_step": step}
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **options) as engine:
        endings = set()
        for seed in range(8):
            body = {"model": engine.name, "prompt": QUESTION, "max_tokens": 12, "seed": seed, "stop": STOPS,
                    "logprobs": 1, "return_token_ids": True, "temperature": 1.0,
                    "kv_transfer_params": {"include_output_tokens": True,
                                           "hidden_states_path": str(tmp_path / f"s{seed}.safetensors")}}  # fmt: skip
            whole = json.loads(_post_json(engine.url, body))  # the same request, unstreamed
            code, headers, events = stream_post(
                engine.url, body | {"stream": True, "stream_options": {"include_usage": True}}
            )
            assert code == 200 and headers["content-type"].startswith("text/event-stream")
            assert headers["transfer-encoding"] == "chunked"
            assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and "usage" in events[-2]
            chunks, w = events[:-2], whole["choices"][0]
            assert all(set(c) == CHUNK_KEYS and set(c["choices"][0]) == CHOICE_KEYS for c in chunks)
            assert "".join(c["choices"][0]["text"] for c in chunks) == w["text"]
            assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == w["token_ids"]
            lps = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks), [])
            assert lps == pytest.approx(w["logprobs"]["token_logprobs"])
            assert all(len(c["choices"][0]["token_ids"]) <= step for c in chunks)
            assert [c["choices"][0]["prompt_token_ids"] is not None for c in chunks] == [True] + [False] * (
                len(chunks) - 1
            )
            assert all(
                c["kv_transfer_params"] is None and c["choices"][0]["finish_reason"] is None for c in chunks[:-1]
            )
            assert chunks[-1]["kv_transfer_params"] == whole["kv_transfer_params"]
            assert chunks[-1]["choices"][0]["finish_reason"] == w["finish_reason"]
            endings.add(whole["kv_transfer_params"] is None)
        engine.wait_writes()
    assert endings == {True, False}, "both a stop string's ending (no path) and the engine's (its path) were seen"


def _post_json(url: str, body: dict) -> str:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    text = conn.getresponse().read().decode()
    conn.close()
    return text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_through_the_engine_is_the_unstreamed_answer_with_its_score_last(engine_served, chat):
    """stream=True through the openai client in front of the engine: each choice's chunks add up to the
    answer the same seed gives without stream (text and ids), each chunk before the last has a null
    running score (vLLM writes the states when the answer ends), the last the unstreamed `hallucination`;
    the engine was asked to stream, and no file of ours is left."""
    srv, engine, states = engine_served
    c = OpenAI(base_url=srv.url, api_key="-", max_retries=0)
    ask = {"model": "tiny", "n": 3, "seed": 11, "max_tokens": 8}
    if chat:
        messages = [{"role": "user", "content": QUESTION}]
        whole = c.chat.completions.create(messages=messages, **ask)
        before = engine.count
        chunks = list(c.chat.completions.create(messages=messages, stream=True, **ask))
        answers = [ch.message.content for ch in whole.choices]
    else:
        whole = c.completions.create(prompt=QUESTION, **ask)
        before = engine.count
        chunks = list(c.completions.create(prompt=QUESTION, stream=True, **ask))
        answers = [ch.text for ch in whole.choices]
    assert [b.get("stream") for b in engine.requests[before:]] == [True] * 3
    got = streamed(chunks)
    assert sorted(got) == [0, 1, 2]
    for i, w in enumerate(whole.choices):
        g = got[i]
        assert g["text"] == answers[i] and g["ids"] == w.token_ids
        assert set(g["running"]) <= {None}
        h, final = w.hallucination, g["last"].hallucination
        assert g["last"].finish_reason == w.finish_reason and set(final) == set(h)
        assert final["flag"] == h["flag"] and final["reason"] == h["reason"]
        if h["score"] is not None:
            assert final["score"] == pytest.approx(h["score"], abs=1e-6)
    engine.wait_writes()
    srv.service.engine.states.sweep()
    assert ours(states) == []


def test_a_server_that_cannot_give_usable_states_is_refused_at_start(bundle_path, tiny_model_dir, tmp_path):
    from halludetect.scoring.bundle import load_bundle

    layer = load_bundle(bundle_path).layer
    s = scorer(bundle_path, tiny_model_dir)
    others = [k for k in ENGINE_LAYERS if k != layer]
    with pytest.raises(Exception, match=re.escape(f"reads layer {layer}; the engine extracts {sorted(others)}")):
        Service(s, engine=EngineClient("http://127.0.0.1:9/v1", None, others))
    with pytest.raises(Exception, match="cannot be reached"):
        Service(s, engine=EngineClient("http://127.0.0.1:9/v1", None, ENGINE_LAYERS)).start()
    cases = [
        ({}, "names no states file .*not started with hidden-state extraction"),
        ({"hidden_states": [0, 1, 2, 3]}, "another path than the request gave.*allow_custom_save_path"),
        ({"hidden_states": [0, 3], "allow_custom_save_path": True}, "2 layer.*not 4"),
        ({"hidden_states": [0, 1, 2, 3], "allow_custom_save_path": True, "states_tokens": "prompt"}, "prompt's states"),
    ]
    for i, (options, match) in enumerate(cases):
        with FakeVLLM(tiny_model_dir, states_dir=tmp_path / f"shm{i}", **options) as engine:
            client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=tmp_path / f"ours{i}")
            service = Service(s, name="tiny", engine=client, log=lambda *_: None)
            with pytest.raises(Exception, match=match):
                service.start()
            assert ours(tmp_path / f"ours{i}") == [], "the probe's file goes too"


# ------------------------------------------------------------------------------ a hostile engine
VICTIM = "data/bundles/world/world/length.safetensors"  # the repository's own DVC output, say


@pytest.fixture
def victims(tmp_path, bundle_path, tiny_model_dir):
    """Files a lying engine may name: a bundle copy, the model's weights, a DVC output, a user's lock."""
    root = tmp_path / "victims"
    (root / "data/bundles/world/world").mkdir(parents=True)
    shutil.copy(bundle_path, root / "bundle.safetensors")
    shutil.copy(tiny_model_dir / "model.safetensors", root / "model.safetensors")
    shutil.copy(bundle_path, root / VICTIM)
    (root / f"{VICTIM}.lock").write_text("a user's lock")
    return root


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def lie(path_of):
    """A `mutate` naming `path_of(states_dir_of_the_request)` in every reply."""

    def mutate(response, body, n):
        asked = body["kv_transfer_params"]["hidden_states_path"]
        response["kv_transfer_params"] = {"hidden_states_path": str(path_of(os.path.dirname(asked)))}
        return response

    return mutate


def place(how):
    """A `states_writer` that puts `how(path)` in our file's place instead of vLLM's file."""

    def write(path, tensors):
        how(path, tensors)

    return write


HOSTILE = {
    "outside_bundle": dict(mutate=lie(lambda d: VICTIMS / "bundle.safetensors")),
    "outside_model": dict(mutate=lie(lambda d: VICTIMS / "model.safetensors")),
    "dot_dot": dict(mutate=lie(lambda d: f"{d}/../victims/{VICTIM}")),
    "repository_output": dict(mutate=lie(lambda d: VICTIMS / VICTIM)),
    "another_request": dict(mutate=lie(lambda d: f"{d}/hd-{'0' * 24}.safetensors")),
    "directory_named": dict(mutate=lie(lambda d: d)),
    "symlink": dict(states_writer=place(lambda p, t: os.symlink(VICTIMS / "model.safetensors", p))),
    "fifo": dict(states_writer=place(lambda p, t: os.mkfifo(p))),
    "directory": dict(states_writer=place(lambda p, t: os.mkdir(p))),
    "hard_link": dict(states_writer=place(lambda p, t: os.link(VICTIMS / "model.safetensors", p))),
    "int32_zeros": dict(
        states_writer=place(
            lambda p, t: save_file(
                {
                    "hidden_states": torch.zeros(t["hidden_states"].shape, dtype=torch.int32),
                    "token_ids": t["token_ids"],
                },
                str(p),
            )
        )
    ),
    "fewer_rows": dict(
        states_writer=place(
            lambda p, t: save_file(
                {"hidden_states": t["hidden_states"][:-2].contiguous(), "token_ids": t["token_ids"]}, str(p)
            )
        )
    ),
    "other_tokens": dict(
        states_writer=place(
            lambda p, t: save_file({"hidden_states": t["hidden_states"], "token_ids": t["token_ids"].flip(0)}, str(p))
        )
    ),
}
HOSTILE_LOG = dict.fromkeys(HOSTILE, "not the path the request gave") | {
    "symlink": "not a regular file",
    "fifo": "not a regular file",
    "directory": "not a regular file",
    "hard_link": "not a regular file",
    "int32_zeros": "not vLLM's float",
    "fewer_rows": "states for .* token ids",
    "other_tokens": "another request's file",
}
VICTIMS = None  # set per test: the hostile engines above read it when they act


@pytest.mark.hostile
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_engine_gets_a_502_and_touches_nothing_outside(
    case, bundle_path, tiny_model_dir, tmp_path, victims, monkeypatch
):
    global VICTIMS
    import halludetect.lm.engine_states as engine_states

    monkeypatch.setattr(engine_states, "APPEAR_S", 2.0)  # a hostile file that never comes: named soon
    VICTIMS = victims
    states = tmp_path / "ours"
    (tmp_path / "ours-other").mkdir()
    before = snapshot(tmp_path)  # every file of the test's folder: the victims
    logged: list[str] = []
    options = {"hidden_states": [0, 1, 2, 3], "allow_custom_save_path": True}
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **options) as engine:
        client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=states)
        service = Service(scorer(bundle_path, tiny_model_dir, stop=[]), name="tiny", engine=client, log=logged.append)
        with Server(service, port=0, log=lambda *_: None) as srv:
            for attribute, value in HOSTILE[case].items():  # after the start's probe: hostile from the first answer
                setattr(engine, attribute, value)
            code, out = post(srv, {"model": "tiny", "prompt": QUESTION, "max_tokens": 6, "seed": 3})
        assert code == 502, out
        message = out["error"]["message"]
        assert str(tmp_path) not in message and "safetensors" not in message  # no local path for the client
        assert any(re.search(HOSTILE_LOG[case], line) for line in logged), logged
        engine.wait_writes()
    after = snapshot(tmp_path)
    outside = {p: b for p, b in after.items() if states not in p.parents and (tmp_path / "shm") not in p.parents}
    assert outside == {p: b for p, b in before.items() if states not in p.parents}
    assert ours(states) == []


# ------------------------------------------------------------------------------ nothing left behind
def test_after_many_requests_ended_by_stops_and_time_outs_no_file_of_ours_is_left(
    bundle_path, tiny_model_dir, tmp_path
):
    """Over 1,000 engine requests: most ended by a stop string (no path in the reply), every 200th held by
    the engine past the client's time-out (given up: a 502) and its file written later still. After the
    server stops (its last sweep waits for those writers) the states directory holds no file of ours."""
    late: set[str] = set()

    def hold(body, n):  # every 200th request: the reply comes after the client gave up, the file later still
        if n % 200 == 10:
            late.add(body["kv_transfer_params"]["hidden_states_path"])
            return Fault(status=200, delay=4.0)
        return None

    def written(path):
        return 5.0 if str(path) in late else 0.0

    states = tmp_path / "ours"
    options = dict(hidden_states=[0, 1, 2, 3], states_dir=tmp_path / "shm", allow_custom_save_path=True)
    with FakeVLLM(tiny_model_dir, fault=hold, states_delay=written, batch=16, **options) as engine:
        client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=states)
        service = Service(
            scorer(bundle_path, tiny_model_dir, max_new_tokens=3), name="tiny", engine=client, log=lambda *_: None
        )
        with Server(service, port=0, log=lambda *_: None) as srv:
            client.timeout = 3.0  # after the start (the fake loads its model on the first request)
            body = {"model": "tiny", "prompt": QUESTION, "max_tokens": 3, "n": 4}
            with ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(lambda s: post(srv, body | {"seed": s})[0], range(270)))
            assert set(codes) == {200, 502}, codes  # a request whose answer timed out: a 502
            assert engine.stop_string_endings >= 100 and len(late) >= 4
        # the server stopped: its last sweep waited for the late writers
    assert ours(states) == []
    assert len(engine.requests) >= 1000


@pytest.mark.hostile
def test_an_engine_url_with_a_key_in_it_or_no_url_is_refused_without_echoing_the_key():
    with pytest.raises(Exception, match="--engine-key-env") as e:
        EngineClient("http://admin:hunter2@gpu-box:8001/v1", None, ENGINE_LAYERS)
    assert "hunter2" not in str(e.value)
    with pytest.raises(Exception, match="not an http"):
        EngineClient("gpu-box:8001", None, ENGINE_LAYERS)


def _last_id(response, body, n):
    response["choices"][0]["token_ids"][-1] = 10**9  # the one id no states file covers: the output's last
    return response


def _nan_logprob(response, body, n):
    response["choices"][0]["logprobs"]["token_logprobs"][0] = float("nan")
    return response


def _text_logprob(response, body, n):
    response["choices"][0]["logprobs"]["token_logprobs"] = ["-0.5"] * len(response["choices"][0]["token_ids"])
    return response


@pytest.mark.hostile
@pytest.mark.parametrize(
    "mutate, says",
    [(_last_id, "not ids of the model's vocabulary"), (_nan_logprob, "not finite"), (_text_logprob, "not finite")],
    ids=["last_id_outside_vocabulary", "nan_logprob", "logprobs_as_text"],
)
def test_token_ids_and_log_probs_an_engine_sends_are_checked_before_use(
    mutate, says, bundle_path, tiny_model_dir, tmp_path
):
    """The states file covers every output id but the last, and the log-probs are the engine's alone:
    both are checked (a 502 naming what is wrong), never decoded or scored as sent (a 500 before)."""
    options = {"hidden_states": [0, 1, 2, 3], "allow_custom_save_path": True}
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **options) as engine:
        client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=tmp_path / "ours")
        service = Service(scorer(bundle_path, tiny_model_dir, stop=[]), name="tiny", engine=client, log=lambda *_: None)
        with Server(service, port=0, log=lambda *_: None) as srv:
            engine.mutate = mutate
            code, out = post(srv, {"model": "tiny", "prompt": QUESTION, "max_tokens": 6, "seed": 3})
    assert code == 502 and says in out["error"]["message"], out
    assert ours(tmp_path / "ours") == []


def test_a_client_that_leaves_a_stream_through_the_engine_frees_its_slot_and_the_engines_stream(
    bundle_path, tiny_model_dir, tmp_path
):
    """One slot; the engine streams a step every 50 ms. A client reads its first chunk and closes the
    connection: the next request gets the slot (not a 429), and our server closed the engine's stream
    well before its last step (the fake counts a client that left mid-stream; vLLM aborts the request)."""
    from halludetect.scoring.serve import Limits

    options = {"hidden_states": [0, 1, 2, 3], "allow_custom_save_path": True}
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **options) as engine:
        client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=tmp_path / "ours")
        limits = Limits(max_tokens=90, max_n=2, max_batch=4, max_concurrency=1)
        s = scorer(bundle_path, tiny_model_dir, max_new_tokens=90, stop=[])
        service = Service(s, name="tiny", limits=limits, engine=client, log=lambda *_: None)
        with Server(service, port=0, log=lambda *_: None) as srv:
            engine.stream_delay = 0.05  # after the start's probe
            leave_after_first_chunk(srv, LONG | {"stream": True})
            code, out = until_not_429(
                lambda: post(srv, {"model": "tiny", "prompt": QUESTION, "max_tokens": 2, "seed": 2})
            )
            assert code == 200, out
            engine.wait_writes()
            assert engine.streams_left == 1, "the engine's stream was read to its end"
    assert ours(tmp_path / "ours") == []


def _frames_with(edit):
    """A `mutate_stream` applying `edit(chunks)` to the decoded data chunks (before [DONE])."""

    def mutate(frames, body, n):
        chunks = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
        return [f"data: {json.dumps(c)}\n\n" if isinstance(c, dict) else c for c in edit(chunks)] + ["data: [DONE]\n\n"]

    return mutate


def _outside_vocabulary(chunks):
    chunks[0]["choices"][0]["token_ids"] = [10**6]
    return chunks


def _error_naming_our_path(chunks):
    path = chunks[-1]["kv_transfer_params"]["hidden_states_path"]  # the length ended it: the engine names it
    return chunks[:1] + [{"error": {"message": f"CUDA out of memory while writing {path}", "code": 500}}]


def _no_end(chunks):
    return chunks[:-1]


def _after_the_end(chunks):
    return chunks + chunks[-1:]


def _empty_chunks(chunks):
    blank = json.loads(json.dumps(chunks[0]))
    blank["choices"][0] |= {"token_ids": [], "text": "", "logprobs": None}
    return [blank] * 200 + chunks


def _huge_line(chunks):
    chunks[0]["choices"][0]["text"] = "x" * (1 << 21)
    return chunks


def _keep_alives(chunks):
    return [x for c in chunks for x in (": keep-alive\n\n", c)]


def _not_json(chunks):
    return ["data: {not json\n\n", *chunks]


HOSTILE_STREAMS = {
    "outside_vocabulary": (_outside_vocabulary, "not ids of the model's vocabulary"),
    "error_mid_stream": (_error_naming_our_path, "the engine failed mid-stream: CUDA out of memory"),
    "no_end": (_no_end, "ended before the answer finished"),
    "after_the_end": (_after_the_end, "after it finished"),
    "empty_chunks": (_empty_chunks, "more than 14 chunks for max_tokens 6"),
    "huge_line": (_huge_line, "a stream line over 1048576 bytes"),
    "not_json": (_not_json, "not JSON"),
    "not_streamed": (None, "did not stream its answer (Content-Type 'application/json')"),
    "keep_alives": (_keep_alives, None),  # vLLM's --sse-keep-alive-interval comments: skipped, the answer is whole
}


@pytest.mark.hostile
@pytest.mark.parametrize("case", sorted(HOSTILE_STREAMS))
def test_a_hostile_engine_stream_ends_ours_with_an_error_object_naming_it(case, bundle_path, tiny_model_dir, tmp_path):
    """Whatever an engine streams is checked as it comes: ids outside the vocabulary (before any is decoded),
    an error object, no end, more after the end, chunks past what max_tokens allows, a line over 1 MiB, a
    chunk that is not JSON, a reply in one piece (a server that ignores `stream`): our stream ends with an
    error object saying so (then [DONE]), and no file of ours
    is left. Keep-alive comments are skipped and the answer is the unstreamed one."""
    edit, says = HOSTILE_STREAMS[case]
    options = {"hidden_states": [0, 1, 2, 3], "allow_custom_save_path": True}
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **options) as engine:
        client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=tmp_path / "ours")
        service = Service(scorer(bundle_path, tiny_model_dir, stop=[]), name="tiny", engine=client, log=lambda *_: None)
        with Server(service, port=0, log=lambda *_: None) as srv:
            body = {"model": "tiny", "prompt": QUESTION, "max_tokens": 6, "seed": 3}
            whole = post(srv, body)[1]
            if case == "not_streamed":  # a reply in one piece, as a server that ignores `stream` sends it
                engine.fault = lambda body, n: Fault(200, body=json.dumps(whole))
            else:
                engine.mutate_stream = _frames_with(edit)
            code, _, events = stream_post(srv, body | {"stream": True})
        engine.wait_writes()
    assert code == 200 and events[-1] == "[DONE]"
    if says is None:
        assert "error" not in events[-2], events[-2]
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == whole["choices"][0]["text"]
        assert events[-2]["choices"][0]["hallucination"]["score"] == whole["choices"][0]["hallucination"]["score"]
    else:
        assert events[-2]["error"]["code"] == 502 and says in events[-2]["error"]["message"], events[-2]
        assert str(tmp_path) not in json.dumps(events)
    assert ours(tmp_path / "ours") == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_n_answers_of_a_request_are_asked_of_the_engine_at_once(stream, bundle_path, tiny_model_dir, tmp_path):
    """vLLM batches the requests it has: the server sends a request's n answers together. The fake
    holds each of the 4 until all 4 have arrived (one after the other, the first would wait in vain
    and fail the request); the answers are those of the same seed asked one at a time (n = 1 each)."""
    import threading

    options = {"hidden_states": [0, 1, 2, 3], "allow_custom_save_path": True}
    with FakeVLLM(tiny_model_dir, states_dir=tmp_path / "shm", **options) as engine:
        client = EngineClient(engine.url, None, ENGINE_LAYERS, states_dir=tmp_path / "ours")
        service = Service(scorer(bundle_path, tiny_model_dir), name="tiny", engine=client, log=lambda *_: None)
        with Server(service, port=0, log=lambda *_: None) as srv:
            body = {"model": "tiny", "prompt": QUESTION, "max_tokens": 8, "seed": 4, "n": 4}
            alone = post(srv, body)[1]["choices"]
            together = threading.Barrier(4, timeout=60)
            engine.fault = lambda body, n: (together.wait(), None)[1]  # after the start's probe
            if stream:
                code, _, events = stream_post(srv, body | {"stream": True})
                assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
                texts = ["".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i)
                         for i in range(4)]  # fmt: skip
            else:
                code, out = post(srv, body)
                texts = [c["text"] for c in out["choices"]]
        engine.wait_writes()
    assert code == 200 and texts == [c["text"] for c in alone]
    assert ours(tmp_path / "ours") == []

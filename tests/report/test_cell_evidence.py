"""A grid cell's token evidence (halludetect/report/cell_evidence.py, stage evidence) on the miniature
DAG of tests/contract_layout.py: the sparsity of every test answer under each seed, the example
answers chosen by the fixed rule from the seeds' mean score, the figures, and Theorem 2's trace
read from training's gradient_ratio.json."""

import json
import shutil

import numpy as np
import polars as pl
import torch
from matplotlib.colors import to_hex

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.config import GridParams
from halludetect.detectors.data import split_data
from halludetect.detectors.evidence import evidence, tokens_carrying
from halludetect.evaluation.evaluate import load_models
from halludetect.report.cell_evidence import evidence_cell, pick_examples
from halludetect.report.evidence_figures import KEY_NOTE, examples, gradient_ratio
from halludetect.scoring.evidence_views import colour


def test_pick_examples_is_the_fixed_rule():
    ids = ["q3/0", "q1/0", "q2/0", "q0/0", "q4/0"]
    y = np.array([1, 1, 0, 0, 1])
    z = np.array([2.0, 2.0, -1.0, 0.5, -3.0])
    # hallucinated: highest 2.0 twice, the first id (q1/0) wins; lowest q4/0; correct: q0/0 high, q2/0 low
    assert pick_examples(ids, y, z) == [
        (1, "hallucinated, highest score"),
        (4, "hallucinated, lowest score"),
        (3, "correct, highest score"),
        (2, "correct, lowest score"),
    ]
    assert pick_examples(["a"], np.array([0]), np.array([1.0])) == [(0, "correct, highest score")]


def test_the_cell_evidence_of_the_miniature_dag(contract, tiny, tmp_path):
    _, tok = tiny
    root = tmp_path / "cell"
    shutil.copytree(contract / "detectors", root / "detectors")
    best = json.loads((contract / "metrics" / "max.json").read_text())["best_layer"]
    trace = {"epochs": [{"epoch": 1, "pooling": "max", "median_ratio": 3.0}], "best_epoch": 1}
    trace["epochs"][0] |= {"n_bags": 2, "median_t_over_s90_sq": 4.0, "median_t_over_s50_sq": 9.0}
    trace["bags"] = {"T": [4.0, 6.0], "s90": [2.0, None], "ratio": [3.0, 5.0]}
    (root / "detectors" / "max" / f"layer_{best}" / "gradient_ratio.json").write_text(json.dumps({"seed_0": trace}))
    grid = GridParams(models=["tiny"], datasets=["mini"], layers=[0], detectors=["max"])
    result = evidence_cell(
        "tiny",
        "mini",
        grid,
        [0, 1],
        tok,
        eval_dir=contract / "metrics",
        detectors_dir=root / "detectors",
        activations=contract / "activations",
        judgments=contract / "judgments.parquet",
        clusters=contract / "none.parquet",  # read only for the methods that read P_sem
        generations=contract / "generations.parquet",
        questions=contract / "questions.parquet",
        out=tmp_path / "evidence.json",
        responses=tmp_path / "responses.parquet",
        figures_dir=tmp_path / "figs",
    )
    assert json.loads((tmp_path / "evidence.json").read_text()) == json.loads(json.dumps(result))
    for name in ("evidence.png", "sparsity.png", "gradient_ratio.png"):
        assert (tmp_path / "figs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = result["methods"]["max"]
    assert m["layer"] == best and not m["bias_varies"] and m["gradient_ratio"]["seed_0"]["median_ratio"] == 3.0

    # the same figures recomputed here, seed by seed, from the detectors and the layer file
    path = contract / "activations" / layer_filename(best)
    test = split_data(read_layer(path), pl.read_parquet(contract / "judgments.parquet"), "test")
    models = load_models(contract / "detectors" / "max" / f"layer_{best}", "max", best, [0, 1], test.tokens.shape[1])
    bags = test.slice(0, len(test))
    rows = pl.read_parquet(tmp_path / "responses.parquet")
    assert rows.height == 2 * len(test) and rows["response_id"].to_list()[: len(test)] == test.response_ids
    for seed, net in enumerate(models):
        c = evidence(net, bags).contributions
        mine = rows.filter(pl.col("seed") == seed)
        np.testing.assert_array_equal(mine["s90"].to_numpy(), tokens_carrying(c, bags, 0.9).numpy())
        np.testing.assert_array_equal(mine["T"].to_numpy(), test.lengths.numpy())
    y = test.y.numpy()
    hal = rows.filter((pl.col("label") == 1) & pl.col("s90").is_not_nan())
    assert m["classes"]["hallucinated"]["n"] == 2 * int(y.sum())
    assert m["classes"]["hallucinated"]["s90"]["median"] == float(np.median(hal["s90"].to_numpy()))
    # the examples: the seeds' mean score, highest and lowest per class
    with torch.no_grad():
        z = torch.stack([net(bags) for net in models]).mean(0).numpy()
    ids = np.asarray(test.response_ids)
    picked = [e["response_id"] for e in m["examples"]]
    assert picked[0] == ids[y == 1][np.argmax(z[y == 1])] and picked[1] == ids[y == 1][np.argmin(z[y == 1])]
    assert picked[2] == ids[y == 0][np.argmax(z[y == 0])] and picked[3] == ids[y == 0][np.argmin(z[y == 0])]
    np.testing.assert_allclose([e["score"] for e in m["examples"]], [z[list(ids).index(p)] for p in picked], rtol=1e-6)


def test_the_gradient_ratio_figure_says_when_nothing_was_traced():
    fig = gradient_ratio({}, "t")
    assert "nothing traced" in fig.texts[0].get_text()


def test_the_evidence_figure_has_a_colour_key_with_its_scale():
    """evidence.png: a bar coloured by the tokens' own colour function from -full (blue, toward
    correct) through white to +full (red, toward hallucination), named; the full value per method."""
    row = {
        "question": "Where was Tavo born?",
        "answer": " Solvane.",
        "what": "hallucinated, highest score",
        "score": 1.5,
        "tokens": [" Sol", "vane", "."],
        "token_start": [1, 4, 8],
        "token_end": [4, 8, 9],
        "offsets_exact": True,
        "contributions": [0.9, 0.8, -0.2],
    }
    fig = examples({"Max pooling (layer 1)": [row]}, "t")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "colour key" in texts and set(KEY_NOTE) <= set(texts) and "blue: toward correct" in KEY_NOTE[1]
    assert "-full" in texts and "0" in texts and "+full" in texts
    assert any("full colour at ±0.9 logit" in t for t in texts)
    bar = [p.get_facecolor()[:3] for p in fig.axes[0].patches if p.get_width() < 1]  # the key's steps
    ends = [tuple(v / 255 for v in colour(c, 1.0)) for c in (-1.0, 0.0, 1.0)]
    assert np.allclose(bar[0], ends[0]) and np.allclose(bar[len(bar) // 2], ends[1]) and np.allclose(bar[-1], ends[2])


def test_the_gradient_ratio_figure_names_each_seed_in_its_colour():
    trace = {
        "best_epoch": 2,
        "epochs": [{"epoch": e, "median_ratio": 2.0 * e, "median_t_over_s90_sq": 4.0} for e in (1, 2)],
        "bags": {"T": [4.0, 6.0], "s90": [2.0, 3.0], "ratio": [3.0, 5.0]},
    }
    fig = gradient_ratio({"max": {"seed_0": trace, "seed_3": trace}}, "t")
    left, right = fig.axes
    for ax in (left, right):
        legends = [ax.get_legend(), *(a for a in ax.artists if a is not ax.get_legend())]
        entries = {t.get_text(): h for lg in legends for t, h in zip(lg.get_texts(), lg.legend_handles)}
        assert "seed 0" in entries and "seed 3" in entries, list(entries)
        assert [to_hex(entries[s].get_color()) for s in ("seed 0", "seed 3")] == [to_hex("C0"), to_hex("C1")]
    # the curves of seed 3 are drawn in its colour
    assert {to_hex(line.get_color()) for line in left.get_lines()} == {to_hex("C0"), to_hex("C1")}

"""A miniature DAG on a tiny model, written in the per-layer layout the train and evaluate stages
write (issue 14), for the export and scoring tests:

    <root>/questions.parquet, generations.parquet, judgments.parquet
    <root>/activations/layer_LL.h5                           (activations.dump, float16)
    <root>/detectors/<method>/layer_LL/seed_S.safetensors    (training.train_detector, train's metadata)
    <root>/scores/<method>/layer_LL.parquet                  (val and test logits per response and seed)
    <root>/metrics/<method>.json                             (evaluate's schema: best_layer on val, ...)
    <root>/manifest.json                                     (stages.manifest's, for a local model)

Real code at every step (sampling, dump, split data, training, inference); only the labels
are synthetic (alternating per answer), which is all the equality tests need.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
from sklearn.metrics import roc_auc_score

from halludetect.activations.capture import dump
from halludetect.activations.layer_format import layer_files
from halludetect.activations.layer_reader import read_layer
from halludetect.config import GenerateParams, ModelPreset
from halludetect.detectors.build import load_detector, params_for, save_detector
from halludetect.detectors.data import split_data
from halludetect.detectors.inference import score
from halludetect.detectors.training import train_detector
from halludetect.lm.generation import generate
from halludetect.lm.hf_models import n_layers
from halludetect.lm.model_manifest import dir_fingerprint
from halludetect.metrics import split_metrics

SEEDS = [0, 1]


def questions(n: int = 24) -> pl.DataFrame:
    splits = ["train", "val", "test"]
    return pl.DataFrame(
        {
            "id": [f"q{i:02d}" for i in range(n)],
            "question": [f"Where was Tavo Mir{i} born?" for i in range(n)],
            "split": [splits[i % 3] for i in range(n)],
        }
    )


def build(
    root: Path,
    model,
    tokenizer,
    model_dir: Path,
    *,
    method: str = "max",
    positions: str = "predicting",
    seeds: list[int] = SEEDS,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    qs = questions()
    gens = generate(model, tokenizer, qs, GenerateParams(n_samples=3, max_new_tokens=8, stop=[]))
    gens = gens.filter(pl.col("n_tokens") > 0)
    judgments = gens.select("question_id", "sample_index", "split").with_columns(
        label=(pl.int_range(pl.len()) % 2).cast(pl.Int64), kept=pl.lit(True)
    )
    qs.write_parquet(root / "questions.parquet")
    gens.write_parquet(root / "generations.parquet")
    judgments.write_parquet(root / "judgments.parquet")
    top = n_layers(model.config)
    (root / "activations").mkdir()
    dump(
        model,
        tokenizer,
        qs,
        gens,
        root / "activations",
        list(range(top + 1)),
        positions=positions,
        dtype="float16",
        batch_size=64,
        attrs={"model": str(model_dir)},
        log=lambda *_: None,
    )
    params = params_for(method, {"dim": 8, "lr": 1e-2})
    per_layer, splits_by_layer = [], {}
    for layer, path in layer_files(root / "activations").items():
        data = read_layer(path, dtype=None)
        sd = {s: split_data(data, judgments, s, str(path)) for s in ("train", "val", "test")}
        rows, scores = [], {"val": [], "test": []}
        for seed in seeds:
            res = train_detector(method, params, sd["train"], sd["val"], epochs=3, batch_size=16, seed=seed)
            out = root / "detectors" / method / f"layer_{layer}" / f"seed_{seed}.safetensors"
            out.parent.mkdir(parents=True, exist_ok=True)
            save_detector(
                out,
                res.state_dict,
                {
                    "method": method,
                    "layer": layer,
                    "seed": seed,
                    "best_epoch": res.best_epoch,
                    "d": int(sd["train"].tokens.shape[-1]),
                    "params": params.model_dump(),
                },
            )
            det, _ = load_detector(out)
            for split in ("val", "test"):
                z = score(det, sd[split])
                scores[split].append(z)
                for rid, y, n, zi in zip(sd[split].response_ids, sd[split].y.numpy(), sd[split].lengths.numpy(), z):
                    q, s = rid.rsplit("/", 1)
                    rows.append(
                        {
                            "response_id": rid,
                            "question_id": q,
                            "sample_index": int(s),
                            "split": split,
                            "label": int(y),
                            "seed": seed,
                            "score": float(zi),
                            "n_tokens": int(n),
                            "p_sem": None,
                        }
                    )
        table = pl.DataFrame(
            rows,
            schema={
                "response_id": pl.String,
                "question_id": pl.String,
                "sample_index": pl.Int32,
                "split": pl.String,
                "label": pl.Int64,
                "seed": pl.Int64,
                "score": pl.Float64,
                "n_tokens": pl.Int32,
                "p_sem": pl.Float64,
            },
        )
        (root / "scores" / method).mkdir(parents=True, exist_ok=True)
        table.write_parquet(root / "scores" / method / f"layer_{layer}.parquet")
        y = {s: sd[s].y.numpy() for s in ("val", "test")}
        per_layer.append(
            {
                "layer": layer,
                "val_auroc": float(np.mean([roc_auc_score(y["val"], z) for z in scores["val"]])),
                "test_auroc": float(np.mean([roc_auc_score(y["test"], z) for z in scores["test"]])),
            }
        )
        splits_by_layer[layer] = (y, scores)
    best = max(per_layer, key=lambda r: r["val_auroc"])["layer"]
    y, scores = splits_by_layer[best]
    metrics = {
        "model": "tiny",
        "dataset": "mini",
        "method": method,
        "family": "detector",
        "seeds": seeds,
        "best_layer": best,
        "layer_selection": "highest mean validation AUROC over seeds",
        "val": split_metrics(y["val"], scores["val"]),
        "test": split_metrics(y["test"], scores["test"]),
        "layers": per_layer,
    }
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics" / f"{method}.json").write_text(json.dumps(metrics))
    preset = ModelPreset(path=str(model_dir), dtype="float32")
    manifest = {
        "name": "tiny",
        "preset": preset.model_dump(),
        "num_hidden_layers": top,
        "hidden_size": model.config.hidden_size,
        "files": dir_fingerprint(model_dir),
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def dumped_rows(questions: pl.DataFrame, dumped: pl.DataFrame, token_ids: bool = True) -> list[dict]:
    """The dumped answers as scoring input, in the dump's order (question id, sample index)."""
    text = questions.select(question_id="id", question="question")
    gens = dumped.sort("question_id", "sample_index").join(text, on="question_id", maintain_order="left")
    return [
        {
            "id": f"{r['question_id']}/{r['sample_index']}",
            "question": r["question"],
            "answer": r["text"],
            **({"answer_token_ids": r["token_ids"]} if token_ids else {}),
        }
        for r in gens.iter_rows(named=True)
    ]


def assert_bundle_scores_match_dag(
    bundle_path: Path,
    scores_dir: Path,
    questions: pl.DataFrame,
    dumped: pl.DataFrame,
    model_dir: Path,
    batch_size: int,
    p_sem: dict[str, float] | None = None,
) -> int:
    """Score every dumped answer from scratch through the bundle (question, answer and its token
    ids; for a bundle that reads P_sem, each answer's `p_sem` by response id), in the dump's order
    and batch size, so that the model sees the inputs the dump gave it: each test answer gets each
    seed's evaluate logit at the bundle's layer (`scores_dir/layer_LL.parquet`), up to the float
    noise of the detector's batch shape. Returns how many (answer, seed) pairs were compared."""
    from halludetect.scoring.bundle import load_bundle
    from halludetect.scoring.scorer import score_answers

    b = load_bundle(bundle_path)
    rows = dumped_rows(questions, dumped)
    if p_sem is not None:  # answers whose clustering failed have none: the DAG scored them neither
        rows = [{**r, "p_sem": p_sem[r["id"]]} for r in rows if r["id"] in p_sem]
    df = score_answers(bundle_path, rows, model=str(model_dir), per_seed=True, device="cpu", batch_size=batch_size)
    assert df["reason"].null_count() == df.height == len(rows)
    by_id = dict(zip(df["id"], df["seed_scores"]))
    dag = pl.read_parquet(Path(scores_dir) / f"layer_{b.layer}.parquet").filter(pl.col("split") == "test")
    assert dag.height, f"no test scores in {scores_dir}"
    for k, seed in enumerate(b.seeds):
        ids, want = dag.filter(pl.col("seed") == seed).select("response_id", "score")
        np.testing.assert_allclose([by_id[i][k] for i in ids], want.to_numpy(), rtol=1e-5, atol=1e-6)
    return dag.height

"""`halludetect train-layer`: one layer of a method trained from the DVC remote's files, compared
with what dvc.lock records (`halludetect.experiments.sharing`)."""

from __future__ import annotations

import json


def run(args) -> None:
    from pathlib import Path

    from halludetect.config import load_params
    from halludetect.experiments.sharing import train_layer_from_remote

    fetched = train_layer_from_remote(
        Path("."),
        load_params(args.params),
        args.model,
        args.dataset,
        args.method,
        args.layer,
        remote=args.remote,
        jobs=args.jobs,
    )
    print(
        json.dumps(
            {
                "stage": fetched.stage,
                "layer": args.layer,
                "fetched_bytes": fetched.bytes,
                "fetched": fetched.files,
                "recorded": fetched.recorded,
            },
            indent=2,
            sort_keys=True,
        )
    )


def add(sub) -> None:
    tl = sub.add_parser(
        "train-layer",
        help="fetch one layer's states and the labels from the DVC remote and train "
        "a method on that layer (nothing upstream runs)",
        description="Pull the one layer file and the labels that train@<model>-<dataset>-<method> needs "
        "for that layer from the DVC remote, train the layer alone with the stage's own command, and "
        "compare each file it wrote with the version dvc.lock records. Run it in the repository's root.",
    )
    tl.add_argument("--model", required=True, help="model preset (grid.models)")
    tl.add_argument("--dataset", required=True, help="dataset preset (grid.datasets)")
    tl.add_argument("--method", required=True, help="detector (grid.detectors)")
    tl.add_argument("--layer", required=True, type=int, help="layer index (grid.layers; 0 = embeddings)")
    tl.add_argument("--remote", help="DVC remote name (default: the repository's default remote)")
    tl.add_argument("-j", "--jobs", type=int, help="parallel downloads (dvc pull -j)")
    tl.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    tl.set_defaults(run=run)

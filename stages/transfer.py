"""Cross-dataset transfer within one model: every method's detectors trained on dataset A (layer,
seeds, calibration and thresholds chosen on A's validation) evaluated on dataset B's test split."""

from pathlib import Path

from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json
from halludetect.core.errors import DataError
from halludetect.evaluation.transfer import kept_test_judgments, overlapping_questions, pair_name, transfer_method
from halludetect.labels.readers import read_judgments
from halludetect.methods import trained
from stages import common


def trained_layers(layers_dir: Path) -> list[int]:
    """The layers A's train stage trained: its figures files (`layer_<L>.json`). Not grid.layers, which
    this stage need not declare: a change to it re-runs train, whose outputs this stage reads."""
    names = [p.stem for p in Path(layers_dir).glob("layer_*.json")]
    layers = sorted(int(n.removeprefix("layer_")) for n in names if n.removeprefix("layer_").isdigit())
    if not layers:
        raise DataError(f"{layers_dir} holds no layer's figures (layer_<L>.json): re-run its train stage")
    return layers


def run(args, params):
    pair = pair_name(args.train, args.test)
    # Before any state is read: what B's test split holds once A's questions are left out.
    leave_out = []
    if args.train != args.test:
        leave_out = overlapping_questions(
            read_parquet(args.train_questions, f"prepare@{args.train}", "questions table"),
            read_parquet(args.test_questions, f"prepare@{args.test}", "questions table"),
        )
    judgments = kept_test_judgments(read_judgments(args.test_judgments), leave_out, pair, args.test)
    methods = {}
    for method in trained(params.grid.detectors):  # a score has nothing fitted on A to carry over
        methods[method] = transfer_method(
            method,
            pair=pair,
            train_layers=Path(args.train_layers) / method,
            train_scores=Path(args.train_scores) / method,
            train_detectors=Path(args.train_detectors) / method,
            test_activations=Path(args.test_activations),
            test_judgments=judgments,
            test_clusters=Path(args.test_clusters),
            layers=trained_layers(Path(args.train_layers) / method),
            seeds=params.train.seeds,
            bootstrap=params.evaluate.bootstrap,
            seed=params.evaluate.seed,
            fpr_targets=params.export.fpr_targets,
            ece_bins=params.transfer.ece_bins,
        )
        m = methods[method]
        common.log.info(
            "transfer %s %s: layer %d, test AUROC %.3f, ECE %.3f",
            pair,
            method,
            m["layer"],
            m["test"]["auroc"]["mean"],
            m["calibration"]["ece"],
        )
    write_json(
        args.out,
        {
            "model": args.model,
            "train": args.train,
            "test": args.test,
            "in_distribution": args.train == args.test,
            "left_out_questions": {
                "count": len(leave_out),
                "ids": leave_out[:100],
                "why": "test questions of the test dataset whose text is a train or validation question "
                "of the training one",
            },
            "methods": methods,
        },
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [
        ("--model", "model preset name (transfer is within one model)"),
        ("--train", "dataset the detectors were trained on (A)"),
        ("--test", "dataset they are tested on (B)"),
        ("--train-layers", "A's per-layer figures, <dir>/<method>/layer_<L>.json (the layer is chosen on them)"),
        ("--train-scores", "A's per-layer scores, <dir>/<method>/layer_<L>.parquet (calibration, thresholds)"),
        ("--train-detectors", "A's detectors, <dir>/<method>/layer_<L>/seed_<S>.safetensors"),
        ("--train-questions", "A's questions Parquet (its train and validation questions are left out of B)"),
        ("--test-activations", "B's layer files directory"),
        ("--test-judgments", "B's judgments Parquet"),
        ("--test-clusters", "B's clusters Parquet (P_sem and semantic entropy, for the methods that read them)"),
        ("--test-questions", "B's questions Parquet"),
        ("--out", "the pair's transfer metrics JSON"),
    ]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)

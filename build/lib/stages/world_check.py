"""Check the demo world: greedy accuracy by exposure, hallucination rate, log-prob AUROC."""

from pathlib import Path

from halludetect.core.atomic_io import write_json
from halludetect.world.check import evaluate_world
from stages import common


def run(args, params):
    metrics = evaluate_world(Path(args.world), params.generate)
    write_json(args.metrics, metrics)
    common.log.info("world: greedy accuracy by exposure %s", metrics["greedy_accuracy_by_exposure"])


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--world", required=True, help="the world stage's output directory")
    p.add_argument("--metrics", required=True, help="world metrics JSON")
    common.main(run, p)

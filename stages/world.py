"""Build the demo world: knowledge base, corpus, tokenizer, tiny Llama, questions, metrics."""

from pathlib import Path

from halludetect import cli
from halludetect.io import write_json
from halludetect.world import build_world


def run(args, params):
    metrics = build_world(params.world, Path(args.out), log=cli.log.info)
    write_json(args.metrics, metrics)
    cli.log.info("world: %s", metrics["greedy_accuracy_by_exposure"])


if __name__ == "__main__":
    p = cli.parser(__doc__)
    p.add_argument("--out", required=True, help="output directory (model/ and qa.jsonl)")
    p.add_argument("--metrics", required=True, help="world metrics JSON")
    cli.main(run, p)

"""Build the demo world: knowledge base, corpus, tokenizer, tiny Llama and its questions."""

from pathlib import Path

from halludetect.core.atomic_io import write_json
from halludetect.world.build import build_world
from stages import common


def run(args, params):
    report = build_world(params.world, Path(args.out), log=common.log.info)
    write_json(args.metrics, report)


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--out", required=True, help="output directory (model/ and qa.jsonl)")
    p.add_argument("--metrics", required=True, help="training report JSON")
    common.main(run, p)

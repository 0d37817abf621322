"""The world's third dataset: facts the corpus states often, wrongly for a random share of them."""

from halludetect.core.atomic_io import read_jsonl, write_json, write_jsonl
from halludetect.world.misinformed import misinformed_rows
from stages import common


def run(args, params):
    p = params.misinformed
    rows = misinformed_rows(read_jsonl(args.world_qa), p.seed, p.min_exposure, p.share)
    write_jsonl(args.out, rows)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("as_stated", "misinformed")}
    write_json(args.metrics, {"questions": len(rows), "by_kind": kinds, "people": len({r["entity"] for r in rows})})
    common.log.info("misinformed: %d questions %s", len(rows), kinds)


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--world-qa", required=True, help="the world stage's questions (qa.jsonl)")
    p.add_argument("--out", required=True, help="the dataset's questions (JSONL, the common schema)")
    p.add_argument("--metrics", required=True, help="counts JSON")
    common.main(run, p)

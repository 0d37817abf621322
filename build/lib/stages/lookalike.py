"""The world's second dataset: questions about its best-known people and their one-letter look-alikes."""

from halludetect.core.atomic_io import read_jsonl, write_json, write_jsonl
from halludetect.world.lookalike import lookalike_rows
from stages import common


def run(args, params):
    rows = lookalike_rows(read_jsonl(args.world_qa), params.lookalike.seed)
    write_jsonl(args.out, rows)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("known", "lookalike")}
    write_json(args.metrics, {"questions": len(rows), "by_kind": kinds, "people": len({r["entity"] for r in rows})})
    common.log.info("lookalike: %d questions %s", len(rows), kinds)


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--world-qa", required=True, help="the world stage's questions (qa.jsonl)")
    p.add_argument("--out", required=True, help="look-alike questions (JSONL, the common schema)")
    p.add_argument("--metrics", required=True, help="counts JSON")
    common.main(run, p)

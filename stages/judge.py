"""Label answers with the two-pass judge protocol (hallucination = 1)."""

from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json, write_parquet
from halludetect.core.errors import UserError
from halludetect.labels.judges import judge_from, label_distribution, two_pass, unusable_splits
from halludetect.qa.questions import read_questions
from halludetect.qa.responses import select_answers
from stages import common


def run(args, params):
    jp = params.judge
    # Built first: a missing API key fails here, before any file is read.
    judge = judge_from(jp)
    # The answers the detectors see: train sample 0, all val/test samples (as dump selects).
    selected, excluded = select_answers(read_parquet(args.generations, "generate", "generations table"))
    df = two_pass(judge, read_questions(args.questions), selected, second_pass=jp.two_pass)
    write_parquet(args.out, df)
    dist = label_distribution(df)
    metrics = {
        "backend": jp.backend,
        "excluded_empty_answers": excluded["empty_answer"],
        "splits": dist,
        "invalid": {p: int((df[f"{p}_verdict"] == "invalid").sum()) for p in ("pass1", "pass2")},
    }
    if hasattr(judge, "usage"):
        metrics["api"] = judge.usage.report(params.prices)
        common.log.info("judge: %s", metrics["api"])
    write_json(args.metrics, metrics)
    common.log.info("judge: %s", {s: (d["kept"], d["hallucination_rate"]) for s, d in dist.items()})
    # Written first, so the replies can be read; then a split without a single label fails the
    # stage (nonzero exit: DVC records nothing), since no detector could train or be scored on it.
    if unusable := unusable_splits(df):
        raise UserError(
            f"judge: no usable label in {len(unusable)} split(s):\n  "
            + "\n  ".join(unusable)
            + f"\nThe judge's raw replies are in {args.out} (columns pass1_raw, pass2_raw), the counts in "
            f"{args.metrics}. Check judge.{jp.backend} (model, endpoint) against them; replies are cached "
            "per request, so re-running unchanged asks nothing new"
        )
    if invalid := sum(metrics["invalid"].values()):
        common.log.warning("judge: %d invalid verdicts (dropped, never labels); raw replies in %s", invalid, args.out)


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--questions", required=True, help="questions Parquet")
    p.add_argument("--generations", required=True, help="generations Parquet")
    p.add_argument("--out", required=True, help="judgments Parquet")
    p.add_argument("--metrics", required=True, help="label distribution JSON")
    common.main(run, p)

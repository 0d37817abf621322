"""Load a dataset into the common QA schema with a question-level train/val/test split."""

from halludetect.core.atomic_io import write_json, write_parquet
from halludetect.labels.leak import leak_check
from halludetect.qa.datasets import prepare
from stages import common


def run(args, params):
    df, report = prepare(params.dataset(args.dataset), params.prepare, args.dataset)
    write_parquet(args.out, df)
    counts = {s: int(n) for s, n in df.group_by("split").len().iter_rows()}
    # Exact repeats of an earlier record (same id, question, answers, context) are dropped:
    # counted, with their ids (the first 100), so a user sees which.
    repeats = {"count": len(report.repeated_ids), "ids": report.repeated_ids[:100]}
    # The share of questions whose prompt holds a reference answer; the report flags a dataset
    # above report.leak_threshold (labels/leak.py).
    leak = leak_check(df)
    write_json(
        args.metrics,
        {
            "read": report.read,
            "dropped": report.dropped,
            "repeated_records": repeats,
            "questions": df.height,
            "splits": counts,
            "mean_answers": float(df["answers"].list.len().mean()),
            "leak": leak,
        },
    )
    common.log.info(
        "prepare %s: %d questions %s, dropped %s, %d exact repeats, %.1f%% with a reference answer in the prompt",
        args.dataset,
        df.height,
        counts,
        report.dropped,
        len(report.repeated_ids),
        100 * leak["prompt_fraction"],
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--dataset", required=True, help="dataset preset name (params: datasets.<name>)")
    p.add_argument("--out", required=True, help="questions Parquet")
    p.add_argument("--metrics", required=True, help="counts JSON")
    common.main(run, p)

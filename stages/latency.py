"""Time what HaMI (SP) adds to one response when requests come one at a time: K - 1 more answers
to its question and the NLI calls that cluster them, for a few test questions (halludetect/evaluation/latency.py)."""

import os
import tempfile

import polars as pl

from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json
from halludetect.core.devices import resolve_device
from halludetect.core.errors import UserError
from halludetect.evaluation.latency import sequential_cost
from halludetect.labels.nli import nli_from
from halludetect.lm.hf_models import load_model, load_tokenizer
from halludetect.qa.questions import read_questions
from stages import common


def run(args, params):
    lp, cp = params.latency, params.cluster
    preset = params.model(args.model)
    device = resolve_device(lp.device, "latency.device")  # before anything loads
    with tempfile.TemporaryDirectory() as empty_cache:
        # Real NLI calls: an empty call cache of our own, so no cached reply passes for the API's latency
        # (the stage's own process only; the shared cache is never touched).
        os.environ["HALLUDETECT_CACHE"] = empty_cache
        nli = nli_from(cp)
        questions = read_questions(args.questions).filter(pl.col("split") == "test").sort("id").head(lp.questions)
        if questions.height == 0:
            raise UserError(f"{args.questions} has no test question to time")
        model = load_model(preset, device)
        generations = read_parquet(args.generations, "generate", "generations table")
        out = sequential_cost(
            model,
            load_tokenizer(preset),
            nli,
            questions,
            generations,
            params.generate,
            cp.equivalence,
            chat_template=preset.chat_template,
        )
    write_json(args.out, out)
    common.log.info(
        "one response at a time: %.3g s for %d more answers + %.3g s for %.1f NLI calls, on %s",
        out["seconds_extra_samples_per_question"],
        out["extra_samples"],
        out["nli_seconds_per_question"],
        out["nli_calls_per_question"],
        out["device"],
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--model", required=True, help="model preset name")
    p.add_argument("--questions", required=True, help="questions Parquet (the test questions are timed)")
    p.add_argument("--generations", required=True, help="generations Parquet (the answers to cluster)")
    p.add_argument("--out", required=True, help="latency metrics JSON")
    common.main(run, p)

"""Sample K answers per question with prompt 1, recording token ids and log-probabilities.

The sampler is `generate.backend`'s (halludetect/lm/samplers.py): `hf` samples with transformers in
this process (data-parallel: `HALLUDETECT_PROCESSES=N`, or `accelerate launch --multi_gpu
--num_processes N -m stages.generate ...`, shares the units over N processes, one per GPU);
`completions` asks a running vLLM or SGLang server (`generate.endpoint`) and loads only the
tokenizer and the model's config. Both write the same table (halludetect/lm/sampling.py).

Resumable: finished units go to --progress as they complete (with `completions`, every reply
too); a killed run re-started (by `dvc repro`) skips them and gives the same output as an
uninterrupted one.
"""

from halludetect.config import CompletionsParams
from halludetect.core.atomic_io import file_sha256, write_json, write_parquet
from halludetect.core.code_deps import code_digest
from halludetect.core.unit_store import UnitStore
from halludetect.lm.engine_states import states_dir
from halludetect.lm.hf_models import load_tokenizer
from halludetect.lm.parallel import relaunch, workers
from halludetect.lm.samplers import open_sampler
from halludetect.lm.sampling import GENERATIONS_SCHEMA, sample
from halludetect.prompts import GENERATION, template_hash
from halludetect.qa.questions import read_questions
from stages import common


def fingerprint(args, params, preset) -> dict:
    """What the kept units were computed from: any change discards them."""
    sampling = params.generate
    return {
        # how requests reach the engine changes no sample: a resumed run may use other replicas
        "generate": sampling.model_dump(exclude={"endpoint": set(CompletionsParams.TRANSPORT)}),
        "chat_template": preset.chat_template,
        "prompt": template_hash(GENERATION),
        "questions": file_sha256(args.questions),
        "manifest": file_sha256(args.manifest),
        # every file this stage runs (its import closure, as dvc.yaml lists it): an edit to any of
        # them discards the kept units, so a resumed run never mixes units of old and new code
        "code": code_digest("stages.generate"),
    }


def run(args, params):
    me = workers()
    preset = params.model(args.model)
    me.check_placement(args.model, preset)
    questions = read_questions(args.questions)
    store = UnitStore(
        args.progress,
        fingerprint(args, params, preset),
        schema=GENERATIONS_SCHEMA,
        busy_hint=", or give this run another --progress directory",
    )
    try:
        if me.main:
            kept = store.prepare()  # claims the directory: a second run on it stops here
            common.log.info("progress in %s (%d units kept from an earlier run)", args.progress, kept)
        me.barrier()
        tokenizer = load_tokenizer(preset)
        sampler = open_sampler(
            preset,
            params.generate,
            tokenizer,
            device=me.device or params.generate.device,
            states_dir=states_dir(args.out),  # an engine's hidden states, when generate.endpoint.hidden_states asks
        )
        df = sample(
            sampler,
            questions,
            params.generate,
            chat_template=preset.chat_template,
            store=store,
            workers=me,
            log=common.log.info,
        )
    except BaseException:
        store.release()  # an error or an interrupt leaves the units to the next run, unclaimed
        raise
    if not me.main:
        return
    # Wall times go to the metrics, not the Parquet: the same samples then give the same
    # bytes on every run, and DVC does not re-run judge, cluster and dump for a timing change.
    write_parquet(args.out, df.drop("seconds"))
    store.remove()  # and the claim with it
    metrics = {
        "questions": questions.height,
        "samples": df.height,
        "processes": me.size,
        "backend": params.generate.backend,
        "device": sampler.device,
        "seconds_total": round(float(df["seconds"].sum()), 3),
        "seconds_per_sample": float(df["seconds"].mean()) if df.height else 0.0,
        "resampled_after_empty": int((df["attempts"] > 1).sum()),
        "still_empty": int((df["n_tokens"] == 0).sum()),
        "finish_reason": dict(df["finish_reason"].value_counts().iter_rows()),
        "mean_answer_tokens": float(df["n_tokens"].mean()) if df.height else 0.0,
    }
    if sampler.stats:  # an engine's requests sent, replies kept from an interrupted run, tokens, wall time
        metrics["endpoint"] = sampler.stats
    write_json(args.metrics, metrics)
    common.log.info(
        "generated %d answers for %d questions in %.1f s of model time "
        "(%d re-sampled after an empty answer, %d still empty)",
        df.height,
        questions.height,
        metrics["seconds_total"],
        metrics["resampled_after_empty"],
        metrics["still_empty"],
    )


if __name__ == "__main__":
    relaunch("stages.generate")
    p = common.parser(__doc__)
    p.add_argument("--model", required=True, help="model preset name")
    p.add_argument("--questions", required=True, help="questions Parquet (prepare output)")
    p.add_argument("--manifest", required=True, help="model manifest (model output); also keys the progress")
    p.add_argument("--progress", required=True, help="directory for finished units (kept until the output is written)")
    p.add_argument("--out", required=True, help="generations Parquet")
    p.add_argument("--metrics", required=True, help="metrics JSON: counts and model time")
    common.main(run, p)

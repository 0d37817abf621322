"""What every sampler of `generate` shares: the interface, the work units, and the run around them.

A sampler (`generate.backend`, registered in samplers.py) answers the questions of a run: `hf`
samples with transformers in this process (generation.py), `completions` asks a serving engine
(completions.py). Both write the same table (`GENERATIONS_SCHEMA`), and both run inside `sample`:

    units      questions with their prompt ids, sorted by prompt length and cut into units of
               generate.batch_size questions (`make_units`): what a killed run keeps
               (core/unit_store.py) and what parallel processes share out (lm/parallel.py). A
               unit's rows never depend on how many processes ran or where a run was interrupted.
    context    every prompt + generate.max_new_tokens must fit the model's context, checked
               before any sampling (`check_context`, on the model or its config).
    resume     the units a store holds are skipped; the sampler gets the others (`todo`) and puts
               each in the store as it finishes.
    order      the rows come back in the questions' order, then by sample index.

A sampler is an object with `tokenizer`, `context` (what check_context reads), `device` (what the
metrics say sampled), `stats` (counts for the metrics, or None) and `sample_units`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import polars as pl

from halludetect.config import GenerateParams
from halludetect.core.unit_store import UnitStore
from halludetect.lm.model_inputs import check_context, encode_prompt
from halludetect.lm.parallel import Workers

GENERATIONS_SCHEMA = {
    "question_id": pl.String,
    "split": pl.String,
    "sample_index": pl.Int32,
    "text": pl.String,
    "token_ids": pl.List(pl.Int64),
    "token_logprobs": pl.List(pl.Float64),
    "n_tokens": pl.Int32,
    "prompt_tokens": pl.Int32,
    "finish_reason": pl.String,
    "attempts": pl.Int32,
    "seconds": pl.Float64,
}


class Sampler(Protocol):
    tokenizer: object
    context: object  # the model, or its config: what check_context reads
    device: str  # what sampled, in words, for the metrics
    stats: dict | None  # counts for the metrics (an engine's requests), or None

    def sample_units(
        self,
        units: list[list[dict]],
        todo: list[int],
        params: GenerateParams,
        store: UnitStore | None,
        workers: Workers,
        log: Callable[[str], None] | None,
    ) -> dict[int, pl.DataFrame]:
        """Units `todo` of `units` (each a list of question dicts: id, split, prompt), each put in
        `store` as it finishes; returns {unit: its rows} of the units it sampled."""
        ...


def make_units(tokenizer, questions: pl.DataFrame, batch_size: int, chat_template: bool) -> list[list[dict]]:
    """Questions with their prompt ids, sorted by prompt length (less padding), cut into units."""
    records = questions.select("id", "question", "split").to_dicts()
    for position, r in enumerate(records):
        r["prompt"] = encode_prompt(tokenizer, r["question"], chat_template)
        r["position"] = position
    records.sort(key=lambda r: (len(r["prompt"]), r["position"]))
    return [records[i : i + batch_size] for i in range(0, len(records), batch_size)]


def in_question_order(rows: pl.DataFrame, units: list[list[dict]]) -> pl.DataFrame:
    """Rows of every unit back in the questions' order, then by sample index."""
    position = {q["id"]: q["position"] for unit in units for q in unit}
    return (
        rows.with_columns(pl.col("question_id").replace_strict(position, return_dtype=pl.Int64).alias("_pos"))
        .sort("_pos", "sample_index")
        .drop("_pos")
    )


def sample(
    sampler: Sampler,
    questions: pl.DataFrame,
    params: GenerateParams,
    *,
    chat_template: bool = False,
    store: UnitStore | None = None,
    workers: Workers | None = None,
    log: Callable[[str], None] | None = None,
) -> pl.DataFrame | None:
    """`params.n_samples` answers for every question (the module docstring's run): one row per
    (question, sample) in the questions' order. With several `workers`, each process samples its
    share of the units; process 0 returns the merged frame, the others None."""
    workers = workers or Workers()
    if workers.size > 1 and store is None:
        raise ValueError("several processes share their work through a UnitStore: pass store=")
    units = make_units(sampler.tokenizer, questions, params.batch_size, chat_template)
    check_context(
        sampler.context,
        {q["id"]: len(q["prompt"]) for u in units for q in u},
        params.max_new_tokens,
        f"generate.max_new_tokens = {params.max_new_tokens}",
    )
    done = store.finished() if store else set()
    todo = [u for u in workers.share(len(units)) if u not in done]
    if log and done and workers.main:
        log(f"resuming: {len(done)} of {len(units)} units already done")
    results = sampler.sample_units(units, todo, params, store, workers, log)
    if store:
        workers.barrier()
        if not workers.main:
            return None
        merged = store.merge(len(units))
    else:
        merged = pl.concat([results[u] for u in range(len(units))], how="vertical")
    return in_question_order(merged, units)

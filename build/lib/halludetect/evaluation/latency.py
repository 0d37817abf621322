"""What HaMI (SP) costs a deployment that scores one response at a time.

The detector alone needs only the response's hidden states. HaMI (SP) also needs its P_sem: K - 1
more answers to the same question, then the NLI calls that cluster the K answers. `evaluate`
charges that cost two ways:

  amortised   generate's seconds per sample (batched over many questions) and each question's
              share of the batched NLI rounds (cluster_timings): a throughput over a data set
  sequential  measured here: for a few test questions, one at a time, the wall time of sampling
              K - 1 answers to that question alone, then of its NLI calls made one after the
              other, as a service answering one request would (CUDA synchronised)

The sequential NLI time is real calls: for the `openai` backend the stage runs with an empty
call cache of its own, so a cached reply never passes for the API's latency.
"""

from __future__ import annotations

import time

import numpy as np
import polars as pl
import torch

from halludetect.config import GenerateParams
from halludetect.labels.nli.clustering import cluster_question
from halludetect.lm.generation import generate


class OneCallAtATime:
    """An NLI backend that answers every directed pair with a call of its own, in order."""

    def __init__(self, nli):
        self.nli, self.name, self.calls = nli, nli.name, 0

    def relations(self, pairs):
        out = []
        for pair in pairs:
            out += self.nli.relations([pair])
            self.calls += 1
        return out


def _sync(model) -> None:
    if getattr(model, "device", torch.device("cpu")).type == "cuda":
        torch.cuda.synchronize()


def sequential_cost(
    model,
    tokenizer,
    nli,
    questions: pl.DataFrame,
    generations: pl.DataFrame,
    params: GenerateParams,
    equivalence: str,
    chat_template: bool = False,
) -> dict:
    """Per question, alone: seconds to sample K - 1 more answers, seconds and calls to cluster its
    K recorded answers one NLI call at a time. `questions`: the ones to measure (id, question, split)."""
    k = params.n_samples
    alone = params.model_copy(update={"n_samples": max(1, k - 1), "batch_size": 1})
    texts = {
        qid: g.sort("sample_index")["text"].to_list()
        for (qid,), g in generations.filter(pl.col("n_tokens") > 0).group_by("question_id")
    }
    if k > 1:
        generate(model, tokenizer, questions.head(1), alone, chat_template=chat_template)  # warm-up, not timed
    gen_s, nli_s, calls = [], [], []
    for row in questions.iter_rows(named=True):
        if k > 1:  # K = 1: no more answers to sample (and P_sem is 1 for every answer)
            _sync(model)
            t0 = time.perf_counter()
            generate(model, tokenizer, pl.DataFrame([row]), alone, chat_template=chat_template)
            _sync(model)
        gen_s.append(time.perf_counter() - t0 if k > 1 else 0.0)
        seq = OneCallAtATime(nli)
        t0 = time.perf_counter()
        cluster_question(seq, row["question"], texts.get(row["id"], []), equivalence)
        nli_s.append(time.perf_counter() - t0)
        calls.append(seq.calls)
    return {
        "questions": len(gen_s),
        "extra_samples": k - 1,
        "seconds_extra_samples_per_question": float(np.mean(gen_s)),
        "nli_seconds_per_question": float(np.mean(nli_s)),
        "nli_calls_per_question": float(np.mean(calls)),
        "seconds_per_nli_call": float(np.sum(nli_s) / np.sum(calls)) if np.sum(calls) else None,
        "seconds_per_question": float(np.mean(gen_s) + np.mean(nli_s)),
        "device": str(getattr(model, "device", "cpu")),
        "nli_backend": nli.name,
    }

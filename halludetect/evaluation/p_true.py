"""p(True) (Kadavath et al., "Language Models (Mostly) Know What They Know", 2022): the model itself
is asked whether an answer it proposed is true, the question's other samples shown as brainstormed
answers; the score is minus the log-probability it gives to " A" (True), so higher means more
likely hallucinated.

The prompt is the semantic-entropy code's (Farquhar et al., `calculate_p_true`): "Question: ...",
"Brainstormed Answers:" then the other samples and the proposed answer itself, one per line,
"Possible answer: ...", the A) True / B) False choice and "The possible answer is:"; the
probability read is that of the last token of prompt + " A" (their `get_p_true`). `few_shot` > 0
puts that many labelled train questions first, each with its K samples, its sample 0 as the
possible answer and " A" or " B" from the judge's label (their `construct_few_shot_prompt`,
which uses 20); the world's tiny model has a 128-token context, so the default is none.

One forward pass per scored answer, batched (right padding: every real token keeps the position
it has alone), reading the logits of one position per row only. Answers whose prompt does not
fit the model's context, and empty answers, are left out, counted.
"""

from __future__ import annotations

import math
import time

import numpy as np
import polars as pl
import torch

from halludetect.core.errors import DataError
from halludetect.lm.hf_models import context_length, input_device
from halludetect.lm.model_inputs import pad_ids
from halludetect.qa.responses import response_id

TRUE = " A"


def example_block(question: str, proposed: str, brainstorm: list[str], label: int | None = None) -> str:
    """One question of the prompt; with `label` (0 correct, 1 hallucinated) a few-shot example."""
    lines = [f"Question: {question.strip()}", "\nBrainstormed Answers: "]
    sep = " \n" if label is not None else "\n"  # the SE code's few-shot lines end in " \n"
    lines += [a.strip() + sep for a in brainstorm]
    lines += [f"Possible answer: {proposed.strip()}\n", "Is the possible answer:\n", "A) True\n", "B) False\n"]
    lines.append("The possible answer is:")
    if label is not None:
        lines.append(TRUE if label == 0 else " B")
    return "".join(lines)


def p_true_prompt(question: str, proposed: str, others: list[str], few_shot: str = "") -> str:
    """The text whose continuation " A" is scored: few-shot block, then the question with the
    other samples and the proposed answer as brainstorm (the SE code lists the proposed one last)."""
    head = few_shot + "\n" if few_shot else ""
    return head + example_block(question, proposed, [*others, proposed])


def few_shot_block(questions: pl.DataFrame, generations: pl.DataFrame, judgments: pl.DataFrame, n: int) -> str:
    """`n` labelled train questions (by question id order), each with its K samples: sample 0 (the
    judged one) first and as the possible answer, its label as the answer letter."""
    if n == 0:
        return ""
    labelled = judgments.filter((pl.col("split") == "train") & pl.col("kept") & (pl.col("sample_index") == 0))
    chosen = labelled.sort("question_id").head(n)
    if chosen.height < n:
        raise DataError(
            f"detectors.p_true.few_shot is {n} but only {chosen.height} labelled train questions exist: lower it"
        )
    text = dict(zip(questions["id"], questions["question"]))
    blocks = []
    for qid, label in chosen.select("question_id", "label").iter_rows():
        answers = generations.filter(pl.col("question_id") == qid).sort("sample_index")["text"].to_list()
        blocks.append(example_block(text[qid], answers[0], answers, int(label)))
    return "\n".join(blocks)


@torch.no_grad()
def log_p_true(model, tokenizer, prompts: list[str], batch_size: int) -> np.ndarray:
    """log p(last token of prompt + " A" | what precedes it) per prompt: one forward pass each,
    batched, the decoder's states at one position per row through the LM head ([B, V], not [B, W, V])."""
    ids = [tokenizer(p + TRUE, add_special_tokens=True)["input_ids"] for p in prompts]
    order = np.argsort([len(x) for x in ids], kind="stable")  # similar lengths together: less padding
    out = np.empty(len(ids))
    decoder = getattr(model, "model", model)
    head = model.get_output_embeddings()
    device = input_device(model)
    for a in range(0, len(ids), batch_size):
        rows = order[a : a + batch_size]
        batch, mask = pad_ids([ids[r] for r in rows], tokenizer.pad_token_id, left=False)  # [B, W]
        h = decoder(input_ids=batch.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
        last = mask.sum(1).to(device) - 1  # [B] the position of the scored token
        logits = head(h[torch.arange(len(rows), device=device), last - 1]).float()  # [B, V] predicting it
        target = batch.to(device)[torch.arange(len(rows), device=device), last]  # [B]
        out[rows] = torch.log_softmax(logits, -1).gather(1, target[:, None]).squeeze(1).double().cpu().numpy()
    return out


def p_true_scores(
    model,
    tokenizer,
    questions: pl.DataFrame,
    generations: pl.DataFrame,
    judgments: pl.DataFrame,
    *,
    few_shot: int,
    batch_size: int,
) -> tuple[pl.DataFrame, dict, float]:
    """Scores (rid, score = -log p(True), log_p_true) of the kept val and test answers, what was
    left out by reason, and the seconds of the forward passes."""
    text = dict(zip(questions["id"], questions["question"]))
    shots = few_shot_block(questions, generations, judgments, few_shot)
    wanted = judgments.filter(pl.col("kept") & pl.col("split").is_in(["val", "test"]))
    wanted_ids = set(zip(wanted["question_id"], wanted["sample_index"]))
    per_q = {
        qid: g.sort("sample_index")
        for (qid,), g in generations.filter(pl.col("question_id").is_in(wanted["question_id"].unique())).group_by(
            "question_id"
        )
    }
    limit = context_length(model.config)
    rids, prompts, excluded = [], [], {"empty_answer": 0, "too_long": 0}
    for qid, g in sorted(per_q.items()):
        answers = list(zip(g["sample_index"].to_list(), g["text"].to_list(), g["n_tokens"].to_list()))
        for k, answer, n in answers:
            if (qid, k) not in wanted_ids:
                continue
            if n == 0 or not answer.strip():
                excluded["empty_answer"] += 1
                continue
            others = [t for j, t, m in answers if j != k and m > 0 and t.strip()]
            prompt = p_true_prompt(text[qid], answer, others, shots)
            if limit is not None and len(tokenizer(prompt + TRUE, add_special_tokens=True)["input_ids"]) > limit:
                excluded["too_long"] += 1
                continue
            rids.append(response_id(qid, k))
            prompts.append(prompt)
    t0 = time.perf_counter()
    lp = log_p_true(model, tokenizer, prompts, batch_size) if prompts else np.empty(0)
    seconds = time.perf_counter() - t0
    scores = pl.DataFrame(
        {"rid": rids, "score": -lp, "log_p_true": lp},
        schema={"rid": pl.String, "score": pl.Float64, "log_p_true": pl.Float64},
    )
    if scores.height and not math.isfinite(float(np.max(np.abs(lp)))):
        raise ValueError("p(True): a log-probability is not finite (the model's logits overflowed?)")
    return scores, excluded, seconds


def p_true(preset, questions: pl.DataFrame, generations: pl.DataFrame, judgments: pl.DataFrame, p):
    """The score as its train stage computes it (methods/scores.py's declaration): the preset's model
    loaded on `p.device` (detectors.p_true), then `p_true_scores`. Returns the scores, what was left
    out by reason, the seconds of the forward passes and the device."""
    from halludetect.core.devices import resolve_device
    from halludetect.lm.hf_models import load_model, load_tokenizer  # beside context_length: torch is loaded

    device = resolve_device(p.device, "detectors.p_true.device")  # before anything loads
    model = load_model(preset, device).eval()
    scores, excluded, seconds = p_true_scores(
        model, load_tokenizer(preset), questions, generations, judgments, few_shot=p.few_shot, batch_size=p.batch_size
    )
    return scores, excluded, seconds, str(device)

"""The dump's check that the generations' log-probs are this model's.

`token_logprobs` in the generations table are log-softmax of the raw logits at each answer
token: P(A|q), which P_sem and the log-prob baseline rest on. The dump's teacher-forced pass
computes the same quantity from the local weights at the positions that predict each answer
token (one gather on the logits it computes anyway), so every answer is compared. A sampler
that served another model, revision or tokenizer, or an engine that returns processed log-probs
(vLLM's `--logprobs-mode processed_logprobs`: after temperature and top-p) differs by much more
than float noise, and the dump fails, naming the model and the largest difference.

Two criteria (`dump.logprob_check`), their tolerances measured (docs/models-and-generation.md,
"The log-prob check"): the mean |difference| over every token (`mean_tolerance`), and the share
of answers whose own mean |difference| passes `answer_tolerance` (at most `answer_share`: a
replica of several that serves another model spoils its share of the answers, which the mean
over all of them could dilute; a few answers past it are the outliers of a bf16 engine's
noise). Float noise is small and centred; a wrong model, a processed distribution or another
tokenizer moves every answer. The mean is judged once 512 tokens are in (or at the end), the
share as soon as it can no longer end under its bound, so a wrong engine stops the dump at its
first batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from halludetect.core.errors import DataError

MIN_TOKENS_FOR_MEAN = 512  # the mean of fewer tokens is judged only at the end
CHUNK_ROWS = 512  # log-softmax over the vocabulary this many positions at a time (memory)


class LogprobMismatch(DataError):
    """The generations' log-probs are not the dumped model's."""


@torch.no_grad()
def teacher_forced_logprobs(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, tokens: torch.Tensor):
    """log-softmax(logits[rows, cols]) at `tokens`: [N] float64 on the CPU.

    logits [B, W, V]; rows, cols, tokens [N] (the positions that predict each answer token, and
    the token). The softmax runs in float32 a chunk of positions at a time."""
    out = torch.empty(len(rows), dtype=torch.float64)
    for i in range(0, len(rows), CHUNK_ROWS):
        x = logits[rows[i : i + CHUNK_ROWS], cols[i : i + CHUNK_ROWS]].float()  # [c, V]
        picked = x.gather(1, tokens[i : i + CHUNK_ROWS, None]).squeeze(1)  # [c]
        out[i : i + CHUNK_ROWS] = (picked - torch.logsumexp(x, dim=-1)).double().cpu()
    return out


@dataclass
class LogprobCheck:
    """Accumulates the differences batch by batch; raises LogprobMismatch past a tolerance."""

    model: str  # named in the message: preset name, path and revision
    mean_tolerance: float | None
    answer_tolerance: float | None
    answer_share: float = 0.0  # of the answers, how many may pass answer_tolerance
    answers_expected: int = 0  # the answers this process will check (the share's denominator)
    tokens: int = 0
    answers: int = 0
    answers_over: int = 0  # answers whose mean |difference| passes answer_tolerance
    total: float = 0.0  # sum of |difference|
    worst: tuple | None = field(default=None)  # (|difference|, response id, token index, recorded, recomputed)
    worst_answer: tuple | None = field(default=None)  # (mean |difference|, response id, tokens)

    def add(self, recorded: np.ndarray, recomputed: np.ndarray, lengths: np.ndarray, response_ids: list[str]):
        """One batch: recorded and recomputed [N] (answers back to back), lengths [B], their ids."""
        diff = np.abs(np.asarray(recorded, dtype=np.float64) - np.asarray(recomputed, dtype=np.float64))  # [N]
        if not np.isfinite(diff).all():
            i = int(np.flatnonzero(~np.isfinite(diff))[0])
            self.worst = (float("inf"), *self._where(i, lengths, response_ids), float(recorded[i]), recomputed[i])
            self._fail("a log-prob that is not a finite number")
        if diff.size:
            i = int(diff.argmax())
            if self.worst is None or diff[i] > self.worst[0]:
                self.worst = (float(diff[i]), *self._where(i, lengths, response_ids), float(recorded[i]), recomputed[i])
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            means = np.add.reduceat(diff, starts) / lengths  # [B]
            j = int(means.argmax())
            if self.worst_answer is None or means[j] > self.worst_answer[0]:
                self.worst_answer = (float(means[j]), response_ids[j], int(lengths[j]))
            if self.answer_tolerance is not None:
                self.answers_over += int((means > self.answer_tolerance).sum())
        self.tokens += diff.size
        self.total += float(diff.sum())
        self.answers += len(lengths)
        self._check_share()  # as soon as the share cannot end under its bound
        if self.tokens >= MIN_TOKENS_FOR_MEAN:
            self._check_mean()

    def finish(self) -> str:
        """The last checks (the mean over every token, the share); a line for the log."""
        self._check_mean()
        self._check_share()
        if not self.tokens:
            return "log-prob check: no answer tokens"
        return (
            f"log-prob check passed: mean |difference| {self.mean:.3g} over {self.tokens} tokens, largest "
            f"{self.worst[0]:.3g} (answer '{self.worst[1]}' token {self.worst[2]}); answers' largest mean "
            f"{self.worst_answer[0]:.3g}, {self.answers_over} of {self.answers} answers past the answer tolerance"
        )

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0

    def _check_mean(self) -> None:
        if self.mean_tolerance is not None and self.tokens and self.mean > self.mean_tolerance:
            self._fail(
                f"the mean |difference| over {self.tokens} tokens is {self.mean:.3g} nats, over "
                f"dump.logprob_check.mean_tolerance = {self.mean_tolerance:g}"
            )

    def _check_share(self) -> None:
        total = max(self.answers_expected, self.answers)  # the answers this process checks in all
        if self.answer_tolerance is None or self.answers_over <= self.answer_share * total:
            return
        self._fail(
            f"{self.answers_over} of {total} answers differ by more than "
            f"dump.logprob_check.answer_tolerance = {self.answer_tolerance:g} nats a token on average (at most "
            f"answer_share = {self.answer_share:g} of them may); the worst, '{self.worst_answer[1]}', by "
            f"{self.worst_answer[0]:.3g}"
        )

    @staticmethod
    def _where(i: int, lengths: np.ndarray, response_ids: list[str]) -> tuple[str, int]:
        ends = np.cumsum(lengths)
        b = int(np.searchsorted(ends, i, side="right"))
        return response_ids[b], int(i - (ends[b] - lengths[b]))

    def _fail(self, why: str) -> None:
        size, rid, t, recorded, recomputed = self.worst
        raise LogprobMismatch(
            f"the generations' log-probs are not those of {self.model}: {why}. The largest difference: answer "
            f"'{rid}' token {t}, recorded {recorded:.4g} by generate, {float(recomputed):.4g} recomputed from the "
            f"weights (|difference| {size:.3g}). The sampler served another model, revision or tokenizer than the "
            "preset, or processed log-probs (vLLM must run with --logprobs-mode raw_logprobs, its default). Fix "
            "the engine (or the preset), then sample again: `dvc repro -f -s generate@<model>-<dataset>` (a "
            "finished run keeps no replies). A known, accepted difference (an fp8 engine) is let through by "
            "raising dump.logprob_check's tolerances"
        )

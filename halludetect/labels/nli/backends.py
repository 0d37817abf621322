"""Entailment backends: for a batch of (question, A, B), does answer A entail answer B?

Each returns "entailment", "neutral" or "contradiction" per pair, or None when the backend
could not give a valid one (an unparseable LLM reply after its retries). Clustering never
reads None as a relation: the question is marked invalid instead.

- `exact`: offline, normalised equality.
- `hf`: an MNLI sequence classifier (DeBERTa-large-MNLI by default), batched over the
  distinct pairs of a call; the label names come from the model's config.
- `openai`: the paper's prompt 3 through an OpenAI-compatible endpoint (GPT-4o mini in the
  paper), cached and resumable like the judge.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel

from halludetect.core import registry
from halludetect.labels.text import RELATIONS, normalise, parse_choice

Relation = Literal["entailment", "neutral", "contradiction"]
Pair = tuple[str, str, str]  # (question, answer A, answer B)


class NLI(Protocol):
    name: str

    def relations(self, pairs: list[Pair]) -> list[Relation | None]: ...


def get_nli(name: str, **kwargs) -> NLI:
    """The NLI backend `name` of core/registry.py (kind "nli": the three below, or a plugin's)."""
    return registry.resolve("nli", name)(**kwargs)


def nli_from(cp) -> NLI:
    """The NLI backend `cp.backend` names (cp: the `cluster` params), built with its section
    `cluster.<backend>`; a plugin has none, and one named like a key of the section's own
    (`equivalence`) is not handed that key's value (as `judges.base.judge_from`)."""
    section = getattr(cp, cp.backend, None)
    return get_nli(cp.backend, **(section.model_dump() if isinstance(section, BaseModel) else {}))


class ExactNLI:
    """Offline: A entails B iff their normalised texts are equal; otherwise neutral.

    It cannot see paraphrases, so it under-merges; on the demo world, where answers are
    templated sentences, equal normalised text is what "same meaning" means.
    """

    name = "exact"

    def __init__(self, **_):
        pass

    def relations(self, pairs: list[Pair]) -> list[Relation | None]:
        return ["entailment" if normalise(a) == normalise(b) else "neutral" for _, a, b in pairs]


class OpenAINLI:
    """Prompt 3, one call per directed pair; replies parsed strictly (`text.parse_choice`)."""

    name = "openai"

    def __init__(self, **params):
        from halludetect.config import ChatParams
        from halludetect.labels.chat_client import ChatRunner

        self.runner = ChatRunner(ChatParams(**params), where="cluster.openai")
        self.usage = self.runner.usage

    def relations(self, pairs: list[Pair]) -> list[Relation | None]:
        from halludetect.prompts import entailment_prompt

        replies = self.runner.run(
            [entailment_prompt(q, a, b) for q, a, b in pairs], lambda t: parse_choice(t, RELATIONS), desc="NLI"
        )
        return [r.value for r in replies]


def nli_label_map(id2label: dict) -> dict[int, Relation]:
    """Class index -> relation, from a classifier config's id2label (names vary in case and
    spelling across MNLI checkpoints: ENTAILMENT, entailment, LABEL_2 is refused)."""
    out: dict[int, Relation] = {}
    for i, name in id2label.items():
        low = str(name).lower()
        for stem, rel in (("entail", "entailment"), ("neutral", "neutral"), ("contradict", "contradiction")):
            if low.startswith(stem):
                out[int(i)] = rel
    if sorted(out.values()) != ["contradiction", "entailment", "neutral"]:
        raise ValueError(
            f"the classifier's id2label {dict(id2label)} does not name entailment, neutral and contradiction "
            "once each: use an MNLI checkpoint (e.g. microsoft/deberta-large-mnli) or fix its config.json"
        )
    return out


class HFNLI:
    """An MNLI sequence classifier. A call classifies its distinct (premise, hypothesis) pairs
    once each, sorted by length into batches of `batch_size` (little padding)."""

    name = "hf"

    def __init__(
        self,
        path: str,
        revision: str | None = None,
        dtype: str = "float32",
        device: str = "auto",
        batch_size: int = 64,
        max_length: int = 256,
        condition_on_question: bool = False,
        trust_remote_code: bool = False,
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from halludetect.lm.hf_models import ModelError, resolve_device

        self.device = resolve_device(device)
        kw = {"revision": revision, "trust_remote_code": trust_remote_code}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, **kw)
            self.model = (
                AutoModelForSequenceClassification.from_pretrained(
                    path, dtype=getattr(torch, dtype) if dtype != "auto" else "auto", **kw
                )
                .to(self.device)
                .eval()
            )
        except OSError as e:
            raise ModelError(
                f"cluster.hf.path: cannot load the NLI classifier '{path}': {e}. Offline? Download it "
                "and point cluster.hf.path at the local directory"
            ) from None
        try:
            self.labels = nli_label_map(self.model.config.id2label)
        except ValueError as e:
            raise ModelError(f"cluster.hf.path '{path}': {e}") from None
        # Encoders with absolute positions need their real tokens first: pad on the right.
        self.tokenizer.padding_side = "right"
        self.batch_size, self.max_length, self.condition = batch_size, max_length, condition_on_question

    def relations(self, pairs: list[Pair]) -> list[Relation | None]:
        import torch

        texts = [(f"{q} {a}", f"{q} {b}") if self.condition else (a, b) for q, a, b in pairs]
        distinct = sorted(set(texts), key=lambda t: (len(t[0]) + len(t[1]), t))
        found: dict[tuple[str, str], Relation] = {}
        for s in range(0, len(distinct), self.batch_size):
            chunk = distinct[s : s + self.batch_size]
            enc = self.tokenizer(
                [a for a, _ in chunk],
                [b for _, b in chunk],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.inference_mode():
                pred = self.model(**enc).logits.argmax(-1).tolist()  # [B]
            found.update((t, self.labels[c]) for t, c in zip(chunk, pred))
        return [found[t] for t in texts]

"""`openai`: an LLM judge behind any OpenAI-compatible endpoint (the paper: GPT-5 mini).

Pass 1 asks with the reference answers (and the known wrong answers where the dataset lists
them, TruthfulQA's and HaluEval's: `prompts.LABELING_WITH_REFERENCE_AND_INCORRECT`), pass 2 with
prompt 2 (no references, the paper's prompt unchanged). Replies are
parsed strictly (`text.parse_choice`): an unparseable one is asked again, then marked
invalid, which the protocol drops and counts. Calls are cached and resumable (`chat_client.py`, `call_cache.py`).
"""

from __future__ import annotations

from halludetect.config import ChatParams
from halludetect.labels.chat_client import ChatRunner
from halludetect.labels.judges.base import JudgeItem, Verdict
from halludetect.labels.text import YES_NO, parse_choice
from halludetect.prompts import labeling_prompt


class OpenAIJudge:
    name = "openai"

    def __init__(self, **params):
        self.runner = ChatRunner(ChatParams(**params), where="judge.openai")
        self.usage = self.runner.usage

    def judge(self, items: list[JudgeItem], with_reference: bool) -> list[Verdict]:
        ask = [i for i, it in enumerate(items) if it.answer.strip()]
        prompts = [
            labeling_prompt(items[i].question, items[i].answer, items[i].references, items[i].incorrect)
            if with_reference
            else labeling_prompt(items[i].question, items[i].answer)
            for i in ask
        ]
        replies = self.runner.run(prompts, lambda t: parse_choice(t, YES_NO), desc=f"pass {1 if with_reference else 2}")
        out = [Verdict("invalid", "empty answer: not asked")] * len(items)
        for i, r in zip(ask, replies):
            out[i] = Verdict(r.value or "invalid", r.text if r.text is not None else "(no content)")
        return out

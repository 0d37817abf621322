"""`match`: the offline, rule-based judge.

Pass 1 (with references): correct iff some reference answer occurs in the response as a
contiguous run of normalised tokens (SQuAD normalisation).
Pass 2 (the paper's pass without references): a rule cannot use "its own knowledge", so
this backend re-checks leniently instead: correct iff at least `lenient_recall` of some
reference's tokens occur anywhere in the response. An answer that fails pass 1 but passes
pass 2 is a near miss ("Smith" for "John Smith"); the protocol drops it as inconsistent
rather than guessing a label, which is the role pass 2 plays in the paper.

A question with known wrong answers (TruthfulQA's incorrect answers, HaluEval's hallucinated
one) uses them in both passes (`MatchJudge._with_wrong`); the paper's datasets have none and
are judged exactly as above.
"""

from __future__ import annotations

from halludetect.labels.judges.base import JudgeItem, Verdict
from halludetect.labels.text import contains, recall, tokens


class MatchJudge:
    name = "match"

    def __init__(self, lenient_recall: float = 0.5):
        self.lenient_recall = lenient_recall

    def judge(self, items: list[JudgeItem], with_reference: bool) -> list[Verdict]:
        out = []
        for item in items:
            if not item.answer.strip():
                out.append(Verdict("no", "empty answer"))
            elif item.incorrect:
                out.append(self._with_wrong(item, with_reference))
            elif with_reference:
                hit = next((r for r in item.references if contains(item.answer, r)), None)
                out.append(Verdict("yes", f"contains {hit!r}") if hit else Verdict("no", "no reference found"))
            else:
                best = max((recall(item.answer, r), r) for r in item.references)
                if best[0] >= self.lenient_recall:
                    out.append(Verdict("yes", f"recall {best[0]:.2f} of {best[1]!r}"))
                else:
                    out.append(Verdict("no", f"best recall {best[0]:.2f}"))
        return out

    def _with_wrong(self, item: JudgeItem, with_reference: bool) -> Verdict:
        """A question with known wrong answers (TruthfulQA, HaluEval). Pass 1: the longest reference,
        true or wrong, that the answer contains decides (the more specific match: "You will not
        digest the watermelon seeds" holds no wrong answer, "You digest the watermelon seeds" does);
        a tie, or none, is "no". Pass 2: TruthfulQA's own rule, closer to a true answer than to any
        wrong one (token recall), and at least `lenient_recall` of it."""
        if with_reference:
            hits = [(len(tokens(r)), ok, r) for ok, refs in ((1, item.references), (0, item.incorrect)) for r in refs]
            hits = sorted((h for h in hits if contains(item.answer, h[2])), key=lambda h: -h[0])
            if not hits:
                return Verdict("no", "no reference found")
            n, ok, ref = hits[0]
            if ok and not any(h[0] == n and not h[1] for h in hits):
                return Verdict("yes", f"contains {ref!r}")
            return Verdict(
                "no", f"contains the wrong answer {ref!r}" if not ok else f"contains {ref!r} and as long a wrong one"
            )
        true = max((recall(item.answer, r), r) for r in item.references)
        false = max(recall(item.answer, r) for r in item.incorrect)
        if true[0] >= self.lenient_recall and true[0] > false:
            return Verdict("yes", f"recall {true[0]:.2f} of {true[1]!r}, {false:.2f} of a wrong answer")
        return Verdict("no", f"best recall {true[0]:.2f}, {false:.2f} of a wrong answer")

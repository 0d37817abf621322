"""`match`: the offline, rule-based judge.

Pass 1 (with references): correct iff some reference answer occurs in the response as a
contiguous run of normalised tokens (SQuAD normalisation).
Pass 2 (the paper's pass without references): a rule cannot use "its own knowledge", so
this backend re-checks leniently instead: correct iff at least `lenient_recall` of some
reference's tokens occur anywhere in the response. An answer that fails pass 1 but passes
pass 2 is a near miss ("Smith" for "John Smith"); the protocol drops it as inconsistent
rather than guessing a label, which is the role pass 2 plays in the paper.
"""

from __future__ import annotations

from halludetect.labels.judges.base import JudgeItem, Verdict, register
from halludetect.labels.text import contains, recall


@register("match")
class MatchJudge:
    name = "match"

    def __init__(self, lenient_recall: float = 0.5):
        self.lenient_recall = lenient_recall

    def judge(self, items: list[JudgeItem], with_reference: bool) -> list[Verdict]:
        out = []
        for item in items:
            if not item.answer.strip():
                out.append(Verdict("no", "empty answer"))
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

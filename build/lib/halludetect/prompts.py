"""The paper's three prompts (appendix, Setup), as format strings, and pass 1's form with known wrong answers.

They are the specification: generation (prompt 1), labelling (prompt 2) and entailment
(prompt 3). The demo world is trained on prompt 1 so that the same code path that asks
Llama-3.1-8B asks the world model.
"""

from __future__ import annotations

import hashlib

GENERATION = "Answer the following question in a single but complete sentence only.\nQuestion: {question}\nAnswer:"

LABELING = (
    "We are assessing the quality of answers to the following question: {question}\n"
    "The proposed answer is: {predicted_answer}\n"
    "Based on the context of question and your own knowledge, is the proposed answer correct?\n"
    "Please think carefully and respond only with yes or no.\n"
    "Response:"
)

# Pass 1 of the labelling compares with the reference answers. The paper gives no prompt for
# it; this is the semantic-entropy code's (Farquhar et al.), references joined with "; ".
LABELING_WITH_REFERENCE = (
    "We are assessing the quality of answers to the following question: {question}\n"
    "{expected}\n"
    "The proposed answer is: {predicted_answer}\n"
    "Within the context of the question, does the proposed answer mean the same as {which}? "
    "Respond only with yes or no.\n"
    "Response:"
)

# Pass 1 for a dataset that also lists known wrong answers (TruthfulQA's incorrect answers,
# HaluEval's hallucinated one): the same prompt with them named, so that an answer close to a
# listed falsehood ("You digest the watermelon seeds") is not read as matching a true one. Used
# only when a question has wrong answers; the paper's four datasets have none and keep the
# prompt above unchanged.
LABELING_WITH_REFERENCE_AND_INCORRECT = (
    "We are assessing the quality of answers to the following question: {question}\n"
    "{expected}\n"
    "{incorrect}\n"
    "The proposed answer is: {predicted_answer}\n"
    "Within the context of the question, does the proposed answer mean the same as {which} "
    "rather than any of the incorrect answers? Respond only with yes or no.\n"
    "Response:"
)

ENTAILMENT = (
    "Context: Question asked to an AI: '{question}'\n"
    "Answer A: {text1}\n"
    "Answer B: {text2}\n"
    "Determine if Answer A entails Answer B. \n"
    "Respond with only one word: entailment,contradiction, or neutral."
)


def generation_prompt(question: str, template: str = GENERATION) -> str:
    """Prompt 1 for one question. The answer follows after a space the model generates."""
    return template.format(question=question.strip())


def labeling_prompt(
    question: str, answer: str, references: tuple[str, ...] | None = None, incorrect: tuple[str, ...] = ()
) -> str:
    """Prompt 2 (no references: pass 2), or its pass-1 form with the reference answers, and with
    the known wrong answers when there are any (`incorrect`; pass 1 only)."""
    if references is None:
        return LABELING.format(question=question.strip(), predicted_answer=answer.strip())
    refs = [r.strip() for r in references]
    if len(refs) == 1:
        expected, which = f"The expected answer is: {refs[0]}.", "the expected answer"
    else:
        expected = f"The following are expected answers to this question: {'; '.join(refs)}."
        which = "any of the expected answers"
    if incorrect:
        wrong = [w.strip() for w in incorrect]
        listed = (
            f"An incorrect answer is: {wrong[0]}."
            if len(wrong) == 1
            else f"The following are incorrect answers to this question: {'; '.join(wrong)}."
        )
        return LABELING_WITH_REFERENCE_AND_INCORRECT.format(
            question=question.strip(), expected=expected, incorrect=listed, predicted_answer=answer.strip(), which=which
        )
    return LABELING_WITH_REFERENCE.format(
        question=question.strip(), expected=expected, predicted_answer=answer.strip(), which=which
    )


def entailment_prompt(question: str, a: str, b: str) -> str:
    """Prompt 3: does answer A entail answer B?"""
    return ENTAILMENT.format(question=question.strip(), text1=a.strip(), text2=b.strip())


def template_hash(template: str) -> str:
    """Short stable hash recorded in activation files, so states from another prompt are caught."""
    return hashlib.sha256(template.encode()).hexdigest()[:16]

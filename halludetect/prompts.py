"""The paper's three prompts (appendix, Setup), as format strings.

They are the specification: generation (prompt 1), labelling (prompt 2) and entailment
(prompt 3). The demo world is trained on prompt 1 so that the same code path that asks
Llama-3.1-8B asks the world model.
"""

from __future__ import annotations

import hashlib

GENERATION = (
    "Answer the following question in a single but complete sentence only.\n"
    "Question: {question}\n"
    "Answer:"
)

LABELING = (
    "We are assessing the quality of answers to the following question: {question}\n"
    "The proposed answer is: {predicted_answer}\n"
    "Based on the context of question and your own knowledge, is the proposed answer correct?\n"
    "Please think carefully and respond only with yes or no.\n"
    "Response:"
)

ENTAILMENT = (
    "Context: Question asked to an AI: '{question}'\n"
    "Answer A: {text1}\n"
    "Answer B: {text2}\n"
    "Determine if Answer A entails Answer B. \n"
    "Respond with only one word: entailment,contradiction, or neutral."
)

PROMPTS = {"generation": GENERATION, "labeling": LABELING, "entailment": ENTAILMENT}


def generation_prompt(question: str, template: str = GENERATION) -> str:
    """Prompt 1 for one question. The answer follows after a space the model generates."""
    return template.format(question=question.strip())


def template_hash(template: str) -> str:
    """Short stable hash recorded in activation files, so states from another prompt are caught."""
    return hashlib.sha256(template.encode()).hexdigest()[:16]

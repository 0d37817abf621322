"""The paper's prompts (halludetect/prompts.py): prompt 1 ends where the answer starts, the labelling
prompt's pass-1 form names one or several references and pass 2 none, prompt 3 puts answer A before
answer B, and the template hash tells templates apart."""

from halludetect.prompts import GENERATION, entailment_prompt, generation_prompt, labeling_prompt, template_hash


def test_generation_prompt_strips_the_question_and_ends_where_the_answer_starts():
    p = generation_prompt("  Where was Ada born? \n")
    assert p.endswith("Question: Where was Ada born?\nAnswer:")
    assert generation_prompt("Q?", template="{question} =") == "Q? ="


def test_labeling_prompt_names_the_references_in_pass_1_and_none_in_pass_2():
    one = labeling_prompt("Who?", " John Smith. ", (" J. Smith ",))
    assert "The expected answer is: J. Smith.\n" in one and "the same as the expected answer?" in one
    assert "The proposed answer is: John Smith.\n" in one
    several = labeling_prompt("Who?", "Smith", ("John Smith", "J. Smith"))
    assert "expected answers to this question: John Smith; J. Smith." in several
    assert "the same as any of the expected answers?" in several
    blind = labeling_prompt("Who?", "Smith")
    assert "expected" not in blind and "your own knowledge" in blind


def test_entailment_prompt_orders_the_answers():
    p = entailment_prompt(" Where? ", " Paris ", "Lyon")
    assert "'Where?'" in p and p.index("Answer A: Paris\n") < p.index("Answer B: Lyon\n")


def test_template_hash_is_short_stable_and_tells_templates_apart():
    h = template_hash(GENERATION)
    assert len(h) == 16 and h == template_hash(GENERATION)
    assert template_hash(GENERATION + " ") != h


def test_labeling_prompt_lists_wrong_answers_in_pass_1_only_when_given():
    """TruthfulQA's incorrect answers (HaluEval's hallucinated one) join pass 1; the paper's
    prompts are unchanged for a question without any."""
    both = labeling_prompt("Who?", "Smith", ("John Smith",), ("Mary Jones", "Bob"))
    assert (
        "The expected answer is: John Smith.\nThe following are incorrect answers to this question: Mary Jones; Bob.\n"
        in both
    )
    assert "mean the same as the expected answer rather than any of the incorrect answers?" in both
    assert "An incorrect answer is: Bob.\n" in labeling_prompt("Who?", "Smith", ("John Smith",), ("Bob",))
    assert labeling_prompt("Who?", "Smith", ("John Smith",), ()) == labeling_prompt("Who?", "Smith", ("John Smith",))
    assert "incorrect" not in labeling_prompt("Who?", "Smith", ("John Smith",))

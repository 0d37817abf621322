"""Answer text (halludetect/labels/text.py): SQuAD normalisation and containment, and the strict parsing
of a model's yes/no and entailment replies (anything ambiguous is unparseable, never a guess)."""

import pytest

from halludetect.labels.text import RELATIONS, YES_NO, contains, normalise, parse_choice


def test_normalise_and_contains():
    assert normalise("The  Eiffel-Tower!") == "eiffeltower"
    assert contains("He was born in New York City.", "new york")
    assert not contains("He was born in Newark.", "new york")
    assert not contains("anything", "")


@pytest.mark.parametrize(
    "reply, want",
    [
        ("yes", "yes"),
        ("No", "no"),
        ("YES.", "yes"),
        ("**No**", "no"),
        ("Yes, the answer is correct.", "yes"),
        ("no - it was Lyon", "no"),
        ("The answer is no.", None),
        ("Yes... actually no", None),
        ("maybe", None),
        ("", None),
        (None, None),
        ("yesterday", None),
    ],
)
def test_yes_no_replies_parse_strictly(reply, want):
    assert parse_choice(reply, YES_NO) == want


@pytest.mark.parametrize(
    "reply, want",
    [
        ("entailment", "entailment"),
        ("Entailment.", "entailment"),
        ("NEUTRAL", "neutral"),
        ("contradiction: they differ", "contradiction"),
        ("Answer A does not entail answer B", None),
        ("entailment,contradiction, or neutral", None),
        ("Entails", "entailment"),
    ],
)
def test_relation_replies_parse_strictly(reply, want):
    assert parse_choice(reply, RELATIONS) == want

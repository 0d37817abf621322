"""Token pieces and their places in the answer text (halludetect/lm/token_text.py), on the byte-level
BPE tokenizer of the test model: pieces spell the decoded text, a character split over several
byte tokens goes to the token that completes it, spans are exact when the tokens spell the answer
and marked approximate (but monotone and inside the text) when they do not."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from halludetect.lm.token_text import char_spans, token_pieces

ANSWERS = [
    "Treirbron Grumzaipem was born in Solvane.",
    "Zoë Ñandú lives in 北京 — or São Paulo? 🙂",
    "a  b\tc",
    "x",
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_pieces_spell_the_decoded_answer_and_spans_are_exact(tiny, answer):
    _, tok = tiny
    ids = tok(" " + answer, add_special_tokens=False)["input_ids"]  # as the scorer tokenizes an answer
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids)
    spans = char_spans(pieces, answer)
    assert spans.exact
    # each span is its piece; the first piece's leading space (added before tokenizing) is not in the answer
    assert [answer[a:b] for a, b in zip(spans.start, spans.end)] == [pieces[0].lstrip(), *pieces[1:]]
    assert spans.start[0] == 0 and spans.end[-1] == len(answer)


def test_a_character_split_over_byte_tokens_goes_to_the_token_that_completes_it(tiny):
    _, tok = tiny
    ids = tok(" 北", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # an unseen CJK character is several byte tokens here
    pieces = token_pieces(tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) or "".join(pieces) == " 北"
    assert "".join(pieces) == " 北" and "\ufffd" not in "".join(pieces)


def test_stored_answers_are_stripped_and_offsets_point_into_the_stored_text(tiny):
    _, tok = tiny
    text = "  Solvane, of course. "
    ids = tok(" " + text.strip(), add_special_tokens=False)["input_ids"]
    spans = char_spans(token_pieces(tok, ids), text)
    assert spans.exact and spans.start[0] == 2 and spans.end[-1] == len(text.rstrip())


@pytest.mark.hostile
def test_tokens_that_spell_another_text_get_approximate_spans(tiny):
    _, tok = tiny
    ids = tok(" Solvane was his city", add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tok, ids)
    text = "Solvan was the city"  # what the row says; the tokens spell something else
    spans = char_spans(pieces, text)
    assert not spans.exact
    assert all(0 <= a <= b <= len(text) for a, b in zip(spans.start, spans.end))
    assert spans.start == sorted(spans.start) and spans.end == sorted(spans.end)
    # what matches still lands on its match: the tokens of " city" cover "city" (a space before it)
    i = next(i for i in range(len(pieces)) if "".join(pieces[i:]) == " city")
    assert text[spans.start[i] : spans.end[-1]] == " city"


def test_bytes_that_never_make_a_character_stay_in_the_text(tiny):
    """A model can sample byte tokens that form no UTF-8 character: the text has U+FFFD for them,
    and so do the pieces, in place."""
    _, tok = tiny
    ids = tok(" 北", add_special_tokens=False)["input_ids"]
    broken = [ids[1], *tok(" the", add_special_tokens=False)["input_ids"], ids[1]]  # a lead byte, twice, cut off
    pieces = token_pieces(tok, broken)
    assert "".join(pieces) == tok.decode(broken) and "\ufffd" in tok.decode(broken)
    assert char_spans(pieces, tok.decode(broken).strip()).exact


@settings(max_examples=40, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40))
def test_any_text_round_trips_through_pieces_and_spans(tiny, text):
    _, tok = tiny
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    spans = char_spans(pieces, tok.decode(ids))
    assert spans.exact
    assert all(0 <= a <= b <= len(text) for a, b in zip(spans.start, spans.end))

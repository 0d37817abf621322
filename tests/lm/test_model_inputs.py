"""Prompt ids (halludetect/lm/model_inputs.py): with a chat template, prompt 1 goes inside the user turn
and the ids end where the assistant's answer starts."""

from halludetect.lm.model_inputs import encode_prompt


def test_chat_template_prompt(tiny):
    _, tok = tiny
    tok.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<assistant>"
    try:
        ids = encode_prompt(tok, "Where was Tavo born?", chat_template=True)
    finally:
        tok.chat_template = None
    assert all(isinstance(i, int) for i in ids)
    text = tok.decode(ids)
    assert text.startswith("<user>") and "Question: Where was Tavo born?" in text and text.endswith("<assistant>")

"""The views of an explained scores file (halludetect/scoring/evidence_views.py): answers by score,
segments that rebuild each answer, escaping, the cap of a large file with its note, the terminal's
colours, and the HTML page in a real headless browser (Debian's chromium) where one is installed:
each highlighted span is on the text its contribution names, in the colour it says."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from halludetect.core.errors import UserError
from halludetect.scoring.answer_files import output_schema
from halludetect.scoring.evidence_views import (
    MAX_CHARS,
    MAX_TOKENS,
    colour,
    html_page,
    read_explained,
    segments,
    terminal,
)

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def explained_row(row, answer, pieces, contributions, *, score=None, exact=True, bias=-0.5, question="Q?"):
    """One row as `score --explain` writes it; offsets from the pieces (the first one's leading space dropped)."""
    starts, ends, pos = [], [], 0
    for k, p in enumerate(pieces):
        p = p.lstrip() if k == 0 else p
        starts.append(pos)
        pos += len(p)
        ends.append(pos)
    total = bias + sum(contributions)
    return {
        "row": row,
        "id": f"a{row}",
        "n_tokens": len(pieces),
        "score": total if score is None else score,
        "probability": 0.5,
        "flag": total > 0,
        "reason": None,
        "question": question,
        "answer": answer,
        "tokens": pieces,
        "token_start": starts if exact else [0] * len(pieces),
        "token_end": ends if exact else [0] * len(pieces),
        "offsets_exact": exact,
        "contributions": contributions,
        "bias": bias,
    }


def unscored(row, reason):
    return {"row": row, "id": f"a{row}", "n_tokens": 0, "score": None, "reason": reason}


CAT = explained_row(
    0,
    "The cat sat on the mat.",
    [" The", " cat", " sat", " on", " the", " mat", "."],
    [0.0, 2.0, 0.0, -2.0, 0.0, 1.0, 0.0],
)


def write(tmp_path, rows, fmt="parquet"):
    schema = output_schema(str, False, False, explain=True)
    df = pl.DataFrame([{k: r.get(k) for k in schema} for r in rows], schema=schema)
    path = tmp_path / f"explained.{fmt}"
    if fmt == "parquet":
        df.write_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in df.to_dicts()))
    return path


def test_segments_rebuild_the_answer_with_each_tokens_contribution():
    segs = segments(CAT)
    assert "".join(s.text for s in segs) == CAT["answer"]
    assert [(s.text, s.contribution) for s in segs if s.tokens][:2] == [("The", 0.0), (" cat", 2.0)]
    # a token that ends inside a character joins the token that completes it, contributions summed
    split = explained_row(1, "Zoë", [" Zo", "", "ë"], [0.5, 0.25, 0.125])
    split["token_start"], split["token_end"] = [0, 2, 2], [2, 2, 3]
    assert [(s.text, s.contribution) for s in segments(split)] == [("Zo", 0.5), ("ë", 0.375)]
    # tokens that do not spell the text: shown as they decode, never as spans of the text
    odd = explained_row(2, "cat", [" dog", "s"], [1.0, -1.0], exact=False)
    assert [s.text for s in segments(odd)] == ["dog", "s"]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_answers_come_by_score_and_unscored_rows_are_counted(tmp_path, fmt):
    rows = [
        CAT,
        explained_row(1, "Solvane.", [" Sol", "vane", "."], [0.1, 3.0, 0.0]),
        unscored(2, "empty_answer"),
        explained_row(3, "No.", [" No", "."], [-1.0, 0.0]),
        unscored(4, "too_long"),
    ]
    ex = read_explained(write(tmp_path, rows, fmt), limit=10)
    assert [r["row"] for r in ex.rows] == [1, 0, 3] and ex.n_rows == 5 and ex.n_scored == 3
    assert ex.not_scored == {"empty_answer": 1, "too_long": 1}
    text = terminal(ex, color=False)
    assert "not scored: empty_answer 1, too_long 1" in text and "\x1b[" not in text
    assert text.index("row 1") < text.index("row 0") < text.index("row 3")
    assert '"vane" +3.000' in text
    coloured = terminal(ex, color=True)
    r, g, b = colour(3.0, ex.scale)
    assert f"\x1b[30;48;2;{r};{g};{b}mvane\x1b[0m" in coloured


def test_the_page_is_self_contained_and_escapes_every_text(tmp_path):
    nasty = explained_row(
        0,
        '<script>alert("x")</script> & "q"',
        [" <script>", 'alert("x")', "</script>", " &", ' "q"'],
        [1.0, 0.5, 0.0, -0.5, 0.25],
        question="<b>bold?</b>",
    )
    page = html_page(read_explained(write(tmp_path, [nasty]), limit=5))
    assert "<script" not in page and "<b>" not in page and "&lt;script&gt;" in page
    assert "http" not in page and "src=" not in page and "@import" not in page  # nothing to load
    assert page.count('class="t"') == 5 and 'data-c="1"' in page


@pytest.mark.hostile
def test_a_large_file_is_capped_with_a_note(tmp_path):
    rows = [explained_row(i, f"answer {i}", [" answer", f" {i}"], [i / 100, 0.0]) for i in range(3000)]
    long = explained_row(3000, "x" * (MAX_TOKENS + 50), ["x"] * (MAX_TOKENS + 50), [0.0] * (MAX_TOKENS + 50))
    long["score"] = 1e9
    ex = read_explained(write(tmp_path, [*rows, long], "jsonl"), limit=200)
    assert len(ex.rows) == 200 and ex.rows[0]["row"] == 3000 and ex.rows[1]["row"] == 2999
    page = html_page(ex)
    assert "Showing the 200 highest-scored of 3,001 scored answers" in page
    assert f"the first {MAX_TOKENS:,} of {MAX_TOKENS + 50:,} tokens shown" in page
    assert page.count('<section class="answer"') == 200 and len(page) < 400_000


@pytest.mark.hostile
def test_a_file_without_evidence_or_a_bad_one_is_one_clear_error(tmp_path):
    plain = tmp_path / "plain.parquet"
    pl.DataFrame({"row": [0], "score": [1.0]}).write_parquet(plain)
    with pytest.raises(UserError, match=r"no token evidence .*score the answers with `halludetect score --explain`"):
        read_explained(plain, 10)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(UserError, match=r"bad.jsonl, line 1: not valid JSON"):
        read_explained(bad, 10)
    with pytest.raises(UserError, match="unknown scores format"):
        read_explained(tmp_path / "x.csv", 10) if (tmp_path / "x.csv").write_text("a") else None
    with pytest.raises(UserError, match="--limit must be at least 1"):
        read_explained(plain, 0)


def hand_made(tmp_path, rows) -> Path:
    """A JSONL file as a person may write it: any value in any field (NaN spelt as Python's json does)."""
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.hostile
def test_control_characters_never_reach_the_terminal_and_bidi_controls_are_marked_in_the_page(tmp_path):
    """An answer that clears the screen, rings the bell, opens a hyperlink or reverses the text after
    it: each such character is shown as its escape, in the terminal and in the page (marked, named)."""
    nasty = "\x1b[2J\x07\x1b]8;;http://x\x1b\\Paris\u202eevil\x9b31m"
    pieces = ["\x1b[2J\x07", "\x1b]8;;http://x\x1b\\", "Paris", "\u202eevil", "\x9b31m"]
    row = explained_row(0, nasty, pieces, [0.5, 0.25, 1.0, -1.0, 0.0], question="Where?\x1b[31m\u2066")
    row["id"] = "a\x1b[0m\u202e"
    ex = read_explained(hand_made(tmp_path, [row]), limit=5)
    for color in (False, True):
        text = terminal(ex, color=color)
        colours = text.replace("\x1b[0m", "")
        colours = "".join(part.split("m", 1)[1] if k else part for k, part in enumerate(colours.split("\x1b[30;48;2;")))
        assert not any(c in colours for c in "\x1b\x07\x9b\u202e\u2066"), repr(colours)  # only our own colours
        assert "Where?\\x1b[31m\\u2066" in text and "id 'a\\x1b[0m\\u202e'" in text
    plain = terminal(ex, color=False)
    assert "A: \\x1b[2J\\x07\\x1b]8;;http://x\\x1b\\Paris\\u202eevil\\x9b31m\n" in plain
    page = html_page(ex)
    assert not any(c in page for c in "\x1b\x07\x9b\u202e\u2066")
    assert '<span class="ctl" title="U+202E RIGHT-TO-LEFT OVERRIDE">\\u202e</span>evil' in page
    assert '<span class="ctl" title="U+2066 LEFT-TO-RIGHT ISOLATE">\\u2066</span>' in page
    assert '<span class="ctl" title="U+001B a control character">\\x1b</span>[2J' in page


@pytest.mark.hostile
def test_a_hand_made_files_huge_texts_give_a_bounded_page(tmp_path):
    """A 10 MB question, answer, id and token once gave a 10 MB page: each text is cut, saying so."""
    big = "x" * 10_000_000
    row = explained_row(0, big, [big], [1.0], question=big)
    row["id"] = big
    ex = read_explained(hand_made(tmp_path, [row]), limit=5)
    page, text = html_page(ex), terminal(ex, color=True)
    assert len(page) < 50_000 and len(text) < 50_000
    assert f"the first {MAX_CHARS:,} characters of the answer shown" in page
    assert f"the first {MAX_CHARS:,} characters of the answer shown" in text
    assert "more characters)" in page and "more characters)" in text


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("score", "high", "row 0: 'score' is 'high', not a finite number"),
        ("score", float("nan"), "row 0: 'score' is nan, not a finite number"),
        ("row", "zero", "record 1 of the file: 'row' is 'zero', not a whole number"),
        ("bias", "-0.5", "row 0: 'bias' is '-0.5', not a finite number"),
        ("probability", "0.5", "row 0: 'probability' is '0.5', not a finite number or null"),
        ("contributions", [1.0, float("nan"), 0, 0, 0, 0, 0], "row 0: 'contributions' is [1.0, nan,"),
        ("contributions", [1.0], "row 0: 'contributions' holds 1 values for 7 tokens"),
        ("tokens", None, "row 0: 'tokens' is None, not a list of strings"),
        ("offsets_exact", "yes", "row 0: 'offsets_exact' is 'yes', not true or false"),
        ("token_end", [1.5] * 7, "row 0: 'token_end' is [1.5,"),
    ],
)
def test_a_hand_made_row_of_the_wrong_type_is_one_error_naming_the_row_and_field(tmp_path, field, value, message):
    path = hand_made(tmp_path, [CAT | {field: value}])
    with pytest.raises(UserError) as e:
        ex = read_explained(path, limit=5)
        terminal(ex, color=True), html_page(ex)  # noqa: B018 - neither may fail with a traceback either
    assert message in str(e.value) and "score the answers again with `halludetect score --explain`" in str(e.value)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------ in a browser
GEOMETRY = """<script>
document.body.insertAdjacentHTML("beforeend", '<pre id="boxes">' + JSON.stringify(
  [...document.querySelectorAll("span.t")].map(s => {
    const r = s.getBoundingClientRect();
    return {text: s.textContent, c: parseFloat(s.dataset.c),
            left: r.left, top: r.top, right: r.right, bottom: r.bottom};
  })) + "</pre>");
</script>"""


def chromium(*args: str) -> str:
    res = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",  # tests may run as root (CI containers)
            "--disable-gpu",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "--window-size=1000,900",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.mark.skipif(
    BROWSER is None,
    reason="no headless browser: install Debian's chromium package (apt-get install chromium); .ci/run does",
)
def test_the_page_in_a_browser_highlights_the_tokens_where_the_contributions_say(tmp_path):
    """The page as written is screenshotted; a copy with a script reports where the browser laid
    out each token span. Every span's box, in the screenshot, has the background its contribution
    gives (red, blue, white at 0), and its text is the token's."""
    rows = [
        CAT,
        explained_row(
            1,
            "Treirbron was born in Solvane.",
            [" Treir", "bron", " was", " born", " in", " Sol", "vane", "."],
            [0.0, 0.25, 0.0, 0.0, -0.5, 1.5, 0.75, 0.0],
        ),
    ]
    ex = read_explained(write(tmp_path, rows), limit=10)
    page = tmp_path / "page.html"
    page.write_text(html_page(ex))
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", GEOMETRY + "</body>"))
    profile = f"--user-data-dir={tmp_path / 'profile'}"
    dom = chromium(profile, "--dump-dom", probe.as_uri())
    boxes = json.loads(html.unescape(dom.rsplit('<pre id="boxes">', 1)[1].split("</pre>", 1)[0]))
    shot = tmp_path / "shot.png"
    chromium(profile, f"--screenshot={shot}", page.as_uri())
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)  # [H, W, 3]
    want = [(s.text, s.contribution) for r in ex.rows for s in segments(r) if s.tokens]
    assert [(b["text"], b["c"]) for b in boxes] == [(t, pytest.approx(c, rel=1e-5)) for t, c in want]
    for b in boxes:
        x0, x1, y0, y1 = int(b["left"]) + 1, int(b["right"]) - 1, int(b["top"]) + 1, int(b["bottom"]) - 1
        assert 0 <= x0 < x1 <= pixels.shape[1] and 0 <= y0 < y1 <= pixels.shape[0], b  # laid out in the window
        region = pixels[y0:y1, x0:x1].reshape(-1, 3)
        colours, counts = np.unique(region, axis=0, return_counts=True)
        background = colours[np.argmax(counts)]  # the glyphs are a few pixels; the background is the rest
        np.testing.assert_allclose(background, colour(b["c"], ex.scale), atol=3, err_msg=str(b))
    # the reddest box holds " cat" (+2, the largest), the bluest " on" (-2): full colour at the scale
    red, blue = max(boxes, key=lambda b: b["c"]), min(boxes, key=lambda b: b["c"])
    assert red["text"] == " cat" and blue["text"] == " on" and ex.scale <= 2.0
    y, x = int(red["top"] + red["bottom"]) // 2, int(red["left"]) + 2
    assert tuple(pixels[y, x]) == (214, 39, 40)

"""Token evidence for a person: an explained scores file (`halludetect score --explain`) in the
terminal (coloured spans) and as one self-contained HTML page (`halludetect explain`).

Answers are shown by score, highest first, each with its text coloured token by token: red where
a token pushes the score toward hallucination, blue where it pushes toward a correct answer, the
colour's strength proportional to the contribution (full at `scale`, the 98th percentile of the
shown contributions' sizes, so that one outlier does not wash out the rest). A token whose bytes
end inside a character (its piece is empty) is shown with the token that completes it, their
contributions summed. An answer whose tokens do not spell its text (approximate offsets) is shown
as its tokens decode, with a note, never as misplaced spans of its text.

The page has no script and loads nothing: inline CSS, every text escaped, each span's exact
contribution in its `title` (a tooltip) and `data-c`. A large file is capped: the `limit`
highest-scored answers (and at most MAX_TOKENS tokens and MAX_CHARS characters of each), with a
note saying so; a JSONL file is streamed, keeping only those rows. A hand-made file's other texts
are cut too (a question at MAX_QUESTION characters, an id at MAX_ID, a token in a tooltip or the
top list at MAX_PIECE), saying how much was left out, so a page's size follows `limit`, never the
file's.

Texts come from answers, which anyone may have written: control characters (ESC starts a
terminal's escape sequences: clear the screen, colours, hyperlinks; BEL rings) and the bidi
controls (they reorder the text around them, so what is read is not what is there) are never
written as they are. The terminal shows each as its escape (`\\x1b`, `\\u202e`); the page shows the
same escape, marked, with the character's name in a tooltip. Each shown row's fields are checked
first (`check_row`): a hand-made row with a field of the wrong type or a non-finite number is
one error naming the row and the field.
"""

from __future__ import annotations

import heapq
import html
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from halludetect.core.errors import UserError
from halludetect.scoring.answer_files import EXPLAIN_SCHEMA

MAX_TOKENS = 1000  # tokens shown per answer
MAX_CHARS = 5000  # characters of an answer shown
MAX_QUESTION = 1000  # characters of a question shown
MAX_ID = 200  # characters of an id shown
MAX_PIECE = 40  # characters of one token's text in a tooltip or the top list
# C0 controls but tab and newline (the views lay those out), DEL, C1 controls (0x9b opens an escape
# sequence on some terminals), the line and paragraph separators, and the bidi controls: marks,
# embeddings, overrides and isolates (U+061C, U+200E-F, U+202A-E, U+2066-9)
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
NEEDED = ("row", "score", "answer", *EXPLAIN_SCHEMA)
HALLUCINATION = (214, 39, 40)  # red: toward hallucination
CORRECT = (31, 119, 180)  # blue: toward a correct answer


@dataclass
class Explained:
    path: Path
    rows: list[dict]  # the shown rows, highest score first
    n_rows: int  # every row of the file
    not_scored: dict[str, int]  # reason -> rows
    limit: int
    scale: float = field(init=False)

    def __post_init__(self):
        sizes = [abs(s.contribution) for r in self.rows for s in segments(r) if s.tokens]
        top = max(sizes, default=0.0)
        # the 98th percentile; the largest where most are 0 (HaMI's tokens outside the top k); 1 when all are
        self.scale = float(np.percentile(sizes, 98)) or top if top > 0 else 1.0

    @property
    def n_scored(self) -> int:
        return self.n_rows - sum(self.not_scored.values())


def _check_columns(path: Path, columns) -> None:
    missing = [c for c in NEEDED if c not in columns]
    if missing:
        raise UserError(
            f"{path}: no token evidence (missing {', '.join(missing)}): score the answers with "
            "`halludetect score --explain`"
        )


def _key(r: dict) -> tuple:
    return (r["score"], -r["row"])  # highest score first; on ties, the earlier row


def read_explained(path: str | Path, limit: int) -> Explained:
    """The `limit` highest-scored rows of an explained scores file (Parquet or JSONL), and the
    counts of every row; the file is streamed, memory grows with `limit` only."""
    path = Path(path)
    if limit < 1:
        raise UserError(f"--limit must be at least 1, got {limit}")
    if not path.is_file():
        raise UserError(f"{path}: no such scores file")
    n, reasons, top = 0, {}, []
    for batch in _batches(path):
        for r in batch:
            n += 1
            score = r.get("score")
            if score is None:
                reason = str(r.get("reason") or "unscored")
                reasons[reason] = reasons.get(reason, 0) + 1
                continue
            # what orders the rows, checked before any comparison
            for name, want, ok in (("score", "a finite number", _finite), ("row", "a whole number", _whole)):
                if not ok(r.get(name)):
                    raise UserError(f"{path}: {_where(r, n)}: {_wrong(r, name, want)}; {REWRITE}")
            item = (_key(r), n, r)
            if len(top) < limit:
                heapq.heappush(top, item)
            elif item[0] > top[0][0]:
                heapq.heapreplace(top, item)
    shown = sorted(top, key=lambda t: t[0], reverse=True)
    for _, k, r in shown:  # only the rows shown are read further: those of a huge file cost nothing more
        check_row(path, r, k)
    return Explained(path, [r for _, _, r in shown], n, dict(sorted(reasons.items())), limit)


# ------------------------------------------------------------------------------ a row's fields
REWRITE = "score the answers again with `halludetect score --explain` (a row edited by hand?)"


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _where(r: dict, k: int) -> str:
    """A row as its `row` field names it, or by its place in the file when that is wrong."""
    return f"row {r['row']}" if _whole(r.get("row")) else f"record {k} of the file"


def _wrong(r: dict, field: str, want: str) -> str:
    if field not in r:
        return f"'{field}' is missing (expected {want})"
    got = repr(r[field])
    return f"'{field}' is {got[:60]}{'...' if len(got) > 60 else ''}, not {want}"


# field -> (what it must be, the check); `tokens` sets how long the lists are
FIELDS = {
    "answer": ("a string", lambda v: isinstance(v, str)),
    "question": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "probability": ("a finite number or null", lambda v: v is None or _finite(v)),
    "flag": ("true, false or null", lambda v: v is None or isinstance(v, bool)),
    "bias": ("a finite number", _finite),
    "offsets_exact": ("true or false", lambda v: isinstance(v, bool)),
    "tokens": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "contributions": ("a list of finite numbers", lambda v: isinstance(v, list) and all(_finite(x) for x in v)),
    "token_start": ("a list of whole numbers", lambda v: isinstance(v, list) and all(_whole(x) for x in v)),
    "token_end": ("a list of whole numbers", lambda v: isinstance(v, list) and all(_whole(x) for x in v)),
}


def check_row(path: Path, r: dict, k: int) -> None:
    """A scored row's evidence fields, as `score --explain` writes them; one `UserError` naming the
    row and the first field that is not (`k`: the row's place in the file, 1-based)."""
    for name, (want, ok) in FIELDS.items():
        if name not in r or not ok(r[name]):
            raise UserError(f"{path}: {_where(r, k)}: {_wrong(r, name, want)}; {REWRITE}")
    n = len(r["tokens"])
    for name in ("contributions", "token_start", "token_end"):
        if len(r[name]) != n:
            raise UserError(f"{path}: {_where(r, k)}: '{name}' holds {len(r[name])} values for {n} tokens; {REWRITE}")


def _batches(path: Path):
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise UserError(f"{path}: not a readable Parquet file ({e})") from None
        _check_columns(path, pf.schema_arrow.names)
        for batch in pf.iter_batches(batch_size=4096):
            yield batch.to_pylist()
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            batch, checked = [], False
            for k, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}, line {k}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise UserError(f"{path}, line {k}: expected a JSON object")
                if not checked:  # score writes every row with the same keys
                    _check_columns(path, rec)
                    checked = True
                batch.append(rec)
                if len(batch) == 4096:
                    yield batch
                    batch = []
            yield batch
    else:
        raise UserError(f"{path}: unknown scores format '{path.suffix}': halludetect score writes .parquet or .jsonl")


# ------------------------------------------------------------------------------ segments
@dataclass
class Segment:
    text: str
    contribution: float = 0.0
    tokens: list[tuple[str, float]] = field(default_factory=list)  # (piece, contribution); empty: plain text


def segments(r: dict) -> list[Segment]:
    """The answer as a sequence of plain and token segments (module docstring)."""
    pieces, c = r["tokens"][:MAX_TOKENS], r["contributions"][:MAX_TOKENS]
    if not r["offsets_exact"]:  # the tokens as they decode
        out, pending = [], []
        for p, x in zip(pieces, c):
            pending.append((p, x))
            if p:
                out.append(Segment("".join(q for q, _ in pending), sum(y for _, y in pending), pending))
                pending = []
        if pending:
            out.append(Segment("", sum(y for _, y in pending), pending))
        if out:
            out[0].text = out[0].text.lstrip()
        return out
    text, out, pos, pending = r["answer"], [], 0, []
    for p, x, a, b in zip(pieces, c, r["token_start"], r["token_end"]):
        pending.append((p, x))
        if b <= a:
            continue  # no character of its own: joins the next token that has one
        if a > pos:
            out.append(Segment(text[pos:a]))
        out.append(Segment(text[a:b], sum(y for _, y in pending), pending))
        pos, pending = b, []
    if pending and out and out[-1].tokens:  # trailing tokens without characters: with the last one
        last = out[-1]
        last.tokens, last.contribution = last.tokens + pending, last.contribution + sum(y for _, y in pending)
    elif pending:
        out.append(Segment("", sum(y for _, y in pending), pending))
    if len(r["tokens"]) <= MAX_TOKENS and pos < len(text):  # a cut answer ends at its last shown token
        out.append(Segment(text[pos:]))
    return out


def top_tokens(r: dict, n: int = 5) -> list[tuple[str, float]]:
    """The n segments of largest contribution (toward hallucination)."""
    segs = [s for s in segments(r) if s.tokens]
    return [(s.text, s.contribution) for s in sorted(segs, key=lambda s: -s.contribution)[:n]]


def colour(c: float, scale: float) -> tuple[int, int, int]:
    """White at 0, red toward +scale, blue toward -scale."""
    t = min(abs(c) / scale, 1.0) if scale > 0 else 0.0
    base = HALLUCINATION if c > 0 else CORRECT
    return tuple(round(255 + (v - 255) * t) for v in base)


def _cut_note(r: dict) -> str:
    extra = len(r["tokens"]) - MAX_TOKENS
    return f"the first {MAX_TOKENS:,} of {len(r['tokens']):,} tokens shown" if extra > 0 else ""


def shown(r: dict) -> tuple[list[Segment], str]:
    """`segments(r)` cut after MAX_CHARS characters of text, and the note that says so ('' when whole)."""
    out, used = [], 0
    for seg in segments(r):
        if used + len(seg.text) > MAX_CHARS:
            seg.text = seg.text[: MAX_CHARS - used]
            out.append(seg)
            return out, f"the first {MAX_CHARS:,} characters of the answer shown"
        out.append(seg)
        used += len(seg.text)
    return out, ""


def clip(text: str, n: int) -> str:
    """`text` cut after n characters, saying how many more it holds."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text) - n:,} more characters)"


def _escape(c: str) -> str:
    return {"\n": "\\n", "\r": "\\r"}.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def visible(text: str) -> str:
    """`text` with every control character (CONTROL) and newline written as its escape: nothing of
    it acts on a terminal or reorders what is around it."""
    return CONTROL.sub(lambda m: _escape(m[0]), text.replace("\n", "\\n"))


def _control_html(c: str) -> str:
    name = unicodedata.name(c, "") or "a control character"
    return f'<span class="ctl" title="U+{ord(c):04X} {html.escape(name)}">{html.escape(_escape(c))}</span>'


def text_html(text: str) -> str:
    """`text` escaped for a page, each control character (CONTROL) shown marked as its escape."""
    out, pos = [], 0
    for m in CONTROL.finditer(text):
        out += [html.escape(text[pos : m.start()]), _control_html(m[0])]
        pos = m.end()
    return "".join([*out, html.escape(text[pos:])])


# ------------------------------------------------------------------------------ terminal
def terminal(ex: Explained, color: bool) -> str:
    """The shown answers as text for a terminal: ANSI 24-bit backgrounds when `color`."""
    lines = [_header_text(ex), ""]
    for rank, r in enumerate(ex.rows, 1):
        ident = "" if r.get("id") is None else f"  id {visible(clip(repr(r['id']), MAX_ID))}"
        flag = "  FLAGGED" if r.get("flag") else ""
        prob = "" if r.get("probability") is None else f"  p {r['probability']:.3f}"
        lines.append(f"#{rank}  score {r['score']:.3f}{prob}{flag}  row {r['row']}{ident}")
        lines.append(f"    Q: {visible(clip(r.get('question') or '', MAX_QUESTION))}")
        segs, cut = shown(r)
        answer = "".join(_ansi(s, ex.scale) if color and s.tokens else visible(s.text) for s in segs)
        lines.append(f"    A: {answer}")
        tops = "  ".join(
            f"{visible(json.dumps(clip(t, MAX_PIECE), ensure_ascii=False))} {c:+.3f}" for t, c in top_tokens(r)
        )
        lines.append(f"    top: {tops}   (bias {r['bias']:+.3f})")
        for note in (
            _cut_note(r),
            cut,
            "" if r["offsets_exact"] else "tokens do not spell the answer text: shown as decoded",
        ):
            if note:
                lines.append(f"    note: {note}")
        lines.append("")
    return "\n".join(lines)


def _ansi(s: Segment, scale: float) -> str:
    r, g, b = colour(s.contribution, scale)
    return f"\x1b[30;48;2;{r};{g};{b}m{visible(s.text)}\x1b[0m"


def _header_text(ex: Explained) -> str:
    shown = f"{len(ex.rows):,} of {ex.n_scored:,} scored answers"
    cap = f" (the {ex.limit:,} highest-scored: --limit)" if ex.n_scored > len(ex.rows) else ""
    skipped = ", ".join(f"{visible(clip(k, MAX_ID))} {v}" for k, v in ex.not_scored.items())
    return (
        f"{visible(str(ex.path))}: {shown}{cap}, by score; colour: a token's contribution to the score, red toward "
        f"hallucination, blue toward correct, full at ±{ex.scale:.3g}" + (f"; not scored: {skipped}" if skipped else "")
    )


# ------------------------------------------------------------------------------ HTML
CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.3em; margin-bottom: 0.2em; }
p.meta, p.note { color: #444; font-size: 0.9em; margin: 0.3em 0; }
p.note { color: #8a4b00; }
.legend { display: flex; align-items: center; gap: 0.5em; font-size: 0.85em; margin: 0.8em 0 1.2em; }
.legend .bar { width: 16em; height: 0.9em; border: 1px solid #bbb;
  background: linear-gradient(to right, rgb(31,119,180), #fff, rgb(214,39,40)); }
section.answer { border-top: 1px solid #ddd; padding: 0.6em 0; }
.head { font-size: 0.85em; color: #555; }
.head .score { font-weight: bold; color: #000; }
.head .flag { color: #fff; background: #b22; padding: 0 0.4em; border-radius: 0.2em; }
.q { font-size: 0.9em; color: #555; margin: 0.2em 0; }
.a { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 1em; line-height: 1.9;
  white-space: pre-wrap; word-break: break-word; }
.a .t { padding: 0.15em 0; border-radius: 0; }
.sum { font-size: 0.8em; color: #666; }
.ctl { font-size: 0.8em; color: #fff; background: #8a4b00; padding: 0 0.15em; border-radius: 0.2em; }
"""


def html_page(ex: Explained, title: str | None = None) -> str:
    """One self-contained page (module docstring)."""
    esc = html.escape
    title = title or f"Token evidence: {ex.path.name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(visible(title))}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{text_html(title)}</h1>",
        f'<p class="meta">{esc(_header_text(ex))}.</p>',  # its texts already visible()
    ]
    if ex.n_scored > len(ex.rows):
        parts.append(
            f'<p class="note">Showing the {len(ex.rows):,} highest-scored of {ex.n_scored:,} scored answers '
            f"(halludetect explain --limit); the file has them all.</p>"
        )
    parts.append(
        '<div class="legend"><span>toward correct</span><span class="bar"></span>'
        f"<span>toward hallucination (±{ex.scale:.3g} logit)</span></div>"
    )
    for rank, r in enumerate(ex.rows, 1):
        parts.append(_answer_html(rank, r, ex.scale))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _answer_html(rank: int, r: dict, scale: float) -> str:
    esc = html.escape
    head = [f'<span class="rank">#{rank}</span>', f'<span class="score">score {r["score"]:.3f}</span>']
    if r.get("probability") is not None:
        head.append(f"p {r['probability']:.3f}")
    if r.get("flag"):
        head.append('<span class="flag">flagged</span>')
    head.append(f"row {r['row']}")
    if r.get("id") is not None:
        head.append(f"id {text_html(clip(str(r['id']), MAX_ID))}")
    spans = []
    segs, cut = shown(r)
    for s in segs:
        if not s.tokens:
            spans.append(text_html(s.text))
            continue
        rgb = "rgb({},{},{})".format(*colour(s.contribution, scale))
        tip = "; ".join(f"{json.dumps(clip(p, MAX_PIECE), ensure_ascii=False)} {x:+.4f}" for p, x in s.tokens)
        spans.append(
            f'<span class="t" style="background:{rgb}" data-c="{s.contribution:.6g}" '
            f'title="{esc(visible(tip))}">{text_html(s.text)}</span>'
        )
    notes = [
        n
        for n in (
            _cut_note(r),
            cut,
            "" if r["offsets_exact"] else "tokens do not spell the answer text: shown as decoded",
        )
        if n
    ]
    total = sum(r["contributions"])
    return (
        f'<section class="answer" id="row-{r["row"]}">'
        f'<div class="head">{" · ".join(head)}</div>'
        f'<div class="q">Q: {text_html(clip(r.get("question") or "", MAX_QUESTION))}</div>'
        f'<div class="a">{"".join(spans)}</div>'
        + "".join(f'<p class="note">{esc(n)}</p>' for n in notes)
        + f'<div class="sum">bias {r["bias"]:+.4f} + contributions {total:+.4f} = score {r["score"]:.4f}</div>'
        "</section>"
    )

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
highest-scored answers (and at most MAX_TOKENS tokens of each), with a note saying so; a JSONL
file is streamed, keeping only those rows.
"""

from __future__ import annotations

import heapq
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from halludetect.core.errors import UserError
from halludetect.scoring.answer_files import EXPLAIN_SCHEMA

MAX_TOKENS = 1000  # tokens shown per answer
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
                reason = r.get("reason") or "unscored"
                reasons[reason] = reasons.get(reason, 0) + 1
                continue
            if isinstance(score, bool) or not isinstance(score, int | float):
                raise UserError(f"{path}: row {r.get('row', n - 1)}: score {score!r} is not a number")
            item = (_key(r), n, r)
            if len(top) < limit:
                heapq.heappush(top, item)
            elif item[0] > top[0][0]:
                heapq.heapreplace(top, item)
    rows = [r for _, _, r in sorted(top, key=lambda t: t[0], reverse=True)]
    return Explained(path, rows, n, dict(sorted(reasons.items())), limit)


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


# ------------------------------------------------------------------------------ terminal
def terminal(ex: Explained, color: bool) -> str:
    """The shown answers as text for a terminal: ANSI 24-bit backgrounds when `color`."""
    lines = [_header_text(ex), ""]
    for rank, r in enumerate(ex.rows, 1):
        ident = "" if r.get("id") is None else f"  id {r['id']!r}"
        flag = "  FLAGGED" if r.get("flag") else ""
        prob = "" if r.get("probability") is None else f"  p {r['probability']:.3f}"
        lines.append(f"#{rank}  score {r['score']:.3f}{prob}{flag}  row {r['row']}{ident}")
        lines.append(f"    Q: {_one_line(r.get('question') or '')}")
        answer = "".join(_ansi(s, ex.scale) if color and s.tokens else _one_line(s.text) for s in segments(r))
        lines.append(f"    A: {answer}")
        tops = "  ".join(f"{json.dumps(t, ensure_ascii=False)} {c:+.3f}" for t, c in top_tokens(r))
        lines.append(f"    top: {tops}   (bias {r['bias']:+.3f})")
        for note in (
            _cut_note(r),
            "" if r["offsets_exact"] else "tokens do not spell the answer text: shown as decoded",
        ):
            if note:
                lines.append(f"    note: {note}")
        lines.append("")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return text.replace("\n", "\\n").replace("\r", "\\r")


def _ansi(s: Segment, scale: float) -> str:
    r, g, b = colour(s.contribution, scale)
    return f"\x1b[30;48;2;{r};{g};{b}m{_one_line(s.text)}\x1b[0m"


def _header_text(ex: Explained) -> str:
    shown = f"{len(ex.rows):,} of {ex.n_scored:,} scored answers"
    cap = f" (the {ex.limit:,} highest-scored: --limit)" if ex.n_scored > len(ex.rows) else ""
    skipped = ", ".join(f"{k} {v}" for k, v in ex.not_scored.items())
    return (
        f"{ex.path}: {shown}{cap}, by score; colour: a token's contribution to the score, red toward "
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
"""


def html_page(ex: Explained, title: str | None = None) -> str:
    """One self-contained page (module docstring)."""
    esc = html.escape
    title = title or f"Token evidence: {ex.path.name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="meta">{esc(_header_text(ex))}.</p>',
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
        head.append(f"id {esc(str(r['id']))}")
    spans = []
    for s in segments(r):
        if not s.tokens:
            spans.append(esc(s.text))
            continue
        rgb = "rgb({},{},{})".format(*colour(s.contribution, scale))
        tip = "; ".join(f"{json.dumps(p, ensure_ascii=False)} {x:+.4f}" for p, x in s.tokens)
        spans.append(
            f'<span class="t" style="background:{rgb}" data-c="{s.contribution:.6g}" '
            f'title="{esc(tip)}">{esc(s.text)}</span>'
        )
    notes = [
        n
        for n in (_cut_note(r), "" if r["offsets_exact"] else "tokens do not spell the answer text: shown as decoded")
        if n
    ]
    total = sum(r["contributions"])
    return (
        f'<section class="answer" id="row-{r["row"]}">'
        f'<div class="head">{" · ".join(head)}</div>'
        f'<div class="q">Q: {esc(r.get("question") or "")}</div>'
        f'<div class="a">{"".join(spans)}</div>'
        + "".join(f'<p class="note">{esc(n)}</p>' for n in notes)
        + f'<div class="sum">bias {r["bias"]:+.4f} + contributions {total:+.4f} = score {r["score"]:.4f}</div>'
        "</section>"
    )

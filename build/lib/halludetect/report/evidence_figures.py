"""The figures of a cell's token evidence (drawn by the evidence stage, report/cell_evidence.py).

  evidence         per method, a few test answers with each token's background coloured by its
                   contribution (red toward hallucination, blue toward correct; full colour at
                   the largest contribution shown for that method), under a colour key
  sparsity         the share of an answer's tokens that carry 50% and 90% of its positive
                   evidence, per method and class (seeds pooled)
  gradient_ratio   Theorem 2: per epoch, the median squared gradient-norm ratio of max to mean
                   pooling against the median (T/s)^2; at the best epoch, bag by bag (a colour
                   per seed, named in the legends)

Drawn with matplotlib's object API on Agg, like figures.py. The answers are set in DejaVu Sans
Mono (shipped with matplotlib), each token at its own character column, so a coloured box sits
under exactly the characters of its token whatever the length of the others.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import polars as pl
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import NullFormatter, ScalarFormatter

from halludetect.evaluation.plot_data import CLASS_COLOURS
from halludetect.scoring.evidence_views import colour, segments

MONO = "DejaVu Sans Mono"
FONT = 8.0  # points
ADVANCE = 0.602  # DejaVu Sans Mono's advance width, in em: a character column is ADVANCE * FONT points
WRAP = 110  # characters per line
LINE = 1.75  # line height, in font sizes
KEY = (14, 54, 81)  # the colour key's bar: first and last column, steps from -full to +full
KEY_NOTE = (  # beside the bar, line by line
    "a token's contribution to the bag logit",
    "red: toward hallucination; blue: toward correct",
    "full: each method's ± value in its heading",
)


@cache
def _glyphs() -> frozenset[str]:
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    font = FT2Font(font_manager.findfont(font_manager.FontProperties(family=MONO), fallback_to_default=False))
    return frozenset(chr(c) for c in font.get_charmap())


def _printable(text: str) -> str:
    """One column per character: a line break as ↵, other control characters as ·, a character the
    font has no glyph for as □ (the figure shows what the font can; the HTML page shows the text)."""
    glyphs = _glyphs()
    return "".join("↵" if ch == "\n" else "·" if not ch.isprintable() else ch if ch in glyphs else "□" for ch in text)


def _wrap(segs) -> list[list[tuple[int, str, object]]]:
    """Segments laid out on lines of WRAP columns: per line, (column, text, segment)."""
    lines, line, col = [], [], 0
    for s in segs:
        text = _printable(s.text)
        while text:
            room = WRAP - col
            if room <= 0:
                lines.append(line)
                line, col = [], 0
                continue
            part, text = text[:room], text[room:]
            line.append((col, part, s))
            col += len(part)
    if line or not lines:
        lines.append(line)
    return lines


def examples(per_method: dict[str, list[dict]], title: str) -> Figure:
    """{panel title: [example rows as `score --explain` writes them, plus `what` and `score`]}."""
    blocks = [("key", None), ("key_ticks", None), ("key_note", None), ("gap", None)]  # (kind, payload)
    for name, rows in per_method.items():
        sizes = [abs(s.contribution) for r in rows for s in segments(r) if s.tokens]
        scale = max(sizes) if sizes and max(sizes) > 0 else 1.0
        blocks.append(("method", f"{name}    (full colour at ±{scale:.3g} logit)"))
        for r in rows:
            note = "" if r["offsets_exact"] else ", tokens shown as decoded"
            question = _printable(r["question"] if len(r["question"]) <= 70 else r["question"][:69] + "…")
            blocks.append(("what", f"{r['what']}, score {r['score']:+.3f}{note}    Q: {question}"))
            for line in _wrap(segments(r)):
                blocks.append(("answer", (line, scale)))
        blocks.append(("gap", None))
    col_pt = ADVANCE * FONT
    line_pt = LINE * FONT
    width_in = (WRAP * col_pt) / 72 + 0.5
    height_in = (len(blocks) + 2) * line_pt / 72 + 0.4
    fig = Figure(figsize=(width_in, height_in))
    ax = fig.add_axes((0.25 / width_in, 0.2 / height_in, WRAP * col_pt / 72 / width_in, 1 - 0.6 / height_in))
    ax.set_xlim(0, WRAP)
    ax.set_ylim(len(blocks) + 0.5, -0.5)
    ax.axis("off")
    fig.suptitle(title, fontsize=10, y=1 - 0.08 / height_in, va="top")
    for y, (kind, payload) in enumerate(blocks, start=1):
        if kind == "key":
            _key(ax, y)
        elif kind == "key_ticks":
            _key_ticks(ax, y)
        elif kind == "key_note":
            ax.text(KEY[1] + 1, y, KEY_NOTE[2], fontsize=FONT - 0.5, color="#555555", va="center")
        elif kind == "method":
            ax.text(0, y, payload, fontsize=FONT + 1, fontweight="bold", va="center")
        elif kind == "what":
            ax.text(0, y, payload, fontsize=FONT - 0.5, color="#555555", va="center")
        elif kind == "answer":
            line, scale = payload
            for col, text, seg in line:
                if seg.tokens:
                    rgb = tuple(v / 255 for v in colour(seg.contribution, scale))
                    ax.add_patch(Rectangle((col, y - 0.42), len(text), 0.84, facecolor=rgb, edgecolor="none"))
                ax.text(col, y, text, fontsize=FONT, family=MONO, va="center", ha="left")
    return fig


def _key(ax, y: float) -> None:
    """The colour key: a bar from -full (blue, toward correct) through 0 (white) to +full (red,
    toward hallucination), coloured by the same function as the tokens."""
    first, last, steps = KEY
    width = (last - first) / steps
    ax.text(0, y, "colour key", fontsize=FONT, fontweight="bold", va="center")
    for i, c in enumerate(np.linspace(-1.0, 1.0, steps)):
        rgb = tuple(v / 255 for v in colour(float(c), 1.0))
        ax.add_patch(Rectangle((first + i * width, y - 0.42), width, 0.84, facecolor=rgb, edgecolor="none"))
    ax.add_patch(Rectangle((first, y - 0.42), last - first, 0.84, facecolor="none", edgecolor="#999999", lw=0.5))
    ax.text(last + 1, y, KEY_NOTE[0], fontsize=FONT - 0.5, va="center")


def _key_ticks(ax, y: float) -> None:
    first, last, _ = KEY
    for x, text, ha in ((first, "-full", "left"), ((first + last) / 2, "0", "center"), (last, "+full", "right")):
        ax.text(x, y, text, fontsize=FONT - 0.5, color="#555555", va="center", ha=ha)
    ax.text(last + 1, y, KEY_NOTE[1], fontsize=FONT - 0.5, color="#555555", va="center")


def sparsity(rows: pl.DataFrame, methods: dict, title: str) -> Figure:
    """Box plots of s50 / T and s90 / T per method, hallucinated and correct side by side."""
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    if rows.height == 0:
        for ax in axes:
            ax.text(0.5, 0.5, "no method with token evidence", ha="center", transform=ax.transAxes)
        return fig
    names = list(dict.fromkeys(rows["method"].to_list()))
    for ax, (s, share) in zip(axes, (("s50", "50%"), ("s90", "90%"))):
        for k, (label, cls) in enumerate(((1, "hallucinated"), (0, "correct"))):
            data, pos = [], []
            for i, m in enumerate(names):
                part = rows.filter((pl.col("method") == m) & (pl.col("label") == label) & pl.col(s).is_not_nan())
                data.append((part[s] / part["T"]).to_numpy() if part.height else np.array([np.nan]))
                pos.append(i + (k - 0.5) * 0.36)
            box = ax.boxplot(
                data, positions=pos, widths=0.3, patch_artist=True, showfliers=False, medianprops={"color": "black"}
            )
            for patch in box["boxes"]:
                patch.set(facecolor=CLASS_COLOURS[label], alpha=0.5)
            ax.plot([], [], color=CLASS_COLOURS[label], lw=6, alpha=0.5, label=cls)
        ax.set_xticks(range(len(names)), [methods[m].display for m in names], rotation=35, ha="right", fontsize=8)
        ax.set(title=f"tokens carrying {share} of the positive evidence", ylabel="share of the answer's tokens")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


# gradient_ratio's curves over training: the key of the traced file, line style, legend label
QUANTITIES = (
    ("median_ratio", "-", "ratio ||∇z_max||² / ||∇z_mean||²"),
    ("median_t_over_s90_sq", "--", "(T / s90)²"),
    ("median_t_over_s50_sq", ":", "(T / s50)²"),
    ("median_t_over_s_paper_sq", "-.", "(T / s_B)², the assumption's s_B"),
)


def _seed_handles(seeds: dict) -> list[Line2D]:
    """One legend entry per seed in its colour, named as the traced file names it (seed_0: seed 0)."""
    return [Line2D([], [], color=f"C{k}", lw=2, label=name.replace("seed_", "seed ")) for k, name in enumerate(seeds)]


def gradient_ratio(traced: dict[str, dict], title: str) -> Figure:
    """{method: {seed: {epochs, best_epoch, bags}}} -> per method: the ratio over training, and at
    the best epoch bag by bag against (T/s90)^2 (the theorem's bound, up to its constant)."""
    if not traced:
        fig = Figure(figsize=(8, 2))
        fig.text(0.5, 0.5, "no mean or max pooling network in the grid: nothing traced", ha="center", va="center")
        fig.suptitle(title)
        return fig
    fig = Figure(figsize=(11, 3.9 * len(traced)), layout="constrained")
    axes = fig.subplots(len(traced), 2, squeeze=False)
    for (left, right), (method, seeds) in zip(axes, traced.items()):
        for key, style, _ in QUANTITIES:
            for k, t in enumerate(seeds.values()):
                epochs = [e["epoch"] for e in t["epochs"]]
                values = [np.nan if e.get(key) is None else e[key] for e in t["epochs"]]
                left.plot(epochs, values, ls=style, lw=1.2, color=f"C{k}")
        styles = [Line2D([], [], ls=style, lw=1.2, color="#555555", label=label) for _, style, label in QUANTITIES]
        left.add_artist(left.legend(handles=styles, fontsize=7, loc="upper left"))
        left.legend(handles=_seed_handles(seeds), fontsize=7, loc="upper right", title="seeds", title_fontsize=7)
        left.set(
            yscale="log",
            xlabel="epoch",
            ylabel="median over positive training bags",
            title=f"{method}: over training (a colour per seed)",
        )
        left.grid(alpha=0.3)
        xs, ys = [], []
        for k, t in enumerate(seeds.values()):
            b = t["bags"]
            pairs = [((tt / s) ** 2, r) for tt, s, r in zip(b["T"], b["s90"], b["ratio"]) if s]
            xs += [x for x, _ in pairs]
            ys += [r for _, r in pairs]
            right.scatter([x for x, _ in pairs], [r for _, r in pairs], s=8, alpha=0.5, color=f"C{k}")
        if xs:
            lo, hi = min(min(xs), min(ys)), max(max(xs), max(ys))
            right.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls=":", label="ratio = (T/s90)²")
        right.set(
            xscale="log",
            yscale="log",
            xlabel="(T / s90)²",
            ylabel="ratio",
            title=f"{method}: best epoch, per positive training bag",
        )
        for axis in (right.xaxis, right.yaxis):  # plain numbers: log minor labels overlap
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        right.legend(handles=[*right.get_legend_handles_labels()[0], *_seed_handles(seeds)], fontsize=7)
        right.grid(alpha=0.3)
    fig.suptitle(title)
    return fig

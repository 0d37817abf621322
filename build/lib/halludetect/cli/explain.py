"""`halludetect explain`: an explained scores file (`score --explain`) rendered for a person, in the
terminal or as one HTML page (`halludetect.scoring.evidence_views`)."""

from __future__ import annotations

import os
import sys


def run(args) -> None:
    from halludetect.core.atomic_io import write_text
    from halludetect.scoring.answer_files import check_output
    from halludetect.scoring.evidence_views import html_page, read_explained, terminal

    if args.html:  # a directory, a missing folder or the scores file itself: one line, before reading
        check_output(args.html, "the page (--html)", {"scores file": args.scores})
    limit = args.limit if args.limit is not None else (500 if args.html else 20)  # 0 is refused, not the default
    explained = read_explained(args.scores, limit)
    if args.html:
        write_text(args.html, html_page(explained, args.title))
        print(
            f"written: {args.html} ({len(explained.rows):,} of {explained.n_scored:,} scored answers)", file=sys.stderr
        )
        return
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ)
    print(terminal(explained, color))


def add(sub) -> None:
    ex = sub.add_parser(
        "explain",
        help="show where in each answer its score comes from (an output of `score --explain`)",
        description="Render an explained scores file by score, highest first: each answer's tokens "
        "coloured by their contribution (red toward hallucination, blue toward correct), in the "
        "terminal or as one self-contained HTML page (no script, nothing loaded).",
    )
    ex.add_argument("scores", help="output of `halludetect score --explain` (.parquet or .jsonl)")
    ex.add_argument("--html", help="write one HTML page here instead of printing")
    ex.add_argument(
        "--limit",
        type=int,
        help="the highest-scored answers shown (default: 20 in the terminal, 500 in a page; a note says "
        "how many the file holds)",
    )
    ex.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="terminal colours (default: auto, when printing to a terminal and NO_COLOR is unset)",
    )
    ex.add_argument("--title", help="the page's title (default: from the file's name)")
    ex.set_defaults(run=run)

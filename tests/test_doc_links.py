"""Every relative link of the README and docs/ leads somewhere: the file exists, and a `#fragment`
names one of its headings as GitHub spells their anchors (two links of docs/sweeps-and-sharing.md
led nowhere, issue 52)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a file's headings: lower case, punctuation but - and _ dropped, spaces -."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#+\s+(.*)$", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading(doc):
    broken = []
    for m in LINK.finditer(doc.read_text()):
        target = m.group(1)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc.resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken

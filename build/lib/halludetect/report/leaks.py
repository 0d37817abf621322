"""The leak flag of the tables: a dataset whose prompt holds a reference answer too often.

`prepare` measures, per dataset, the share of questions whose prompt (prompt 1: the question;
no context is shown) contains a reference answer (labels/leak.py, metrics/prepare/<d>.json
`leak`). Above `report.leak_threshold`, every table marks that dataset's columns (and rows)
with `[leak]` and says under the table why its figures mislead: the model can copy the answer,
so its samples agree with each other and with the reference whatever it knows, and the
similarity baselines are trivially strong.
"""

from __future__ import annotations

import json
from pathlib import Path

from halludetect.core.errors import UserError
from halludetect.report.tables import Row, Table

MARK = "[leak]"


def load_leaks(prepare_dir: str | Path, datasets: list[str]) -> dict[str, float]:
    """{dataset: the share of its questions whose prompt holds a reference answer}."""
    out = {}
    for d in datasets:
        path = Path(prepare_dir) / f"{d}.json"
        try:
            leak = json.loads(path.read_text())["leak"]
            out[d] = float(leak["prompt_fraction"])
        except FileNotFoundError:
            raise UserError(f"{path}: missing; run `dvc repro prepare@{d}` (it writes the leak check)") from None
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise UserError(
                f"{path}: no leak check ({type(e).__name__}: {e}); it was written by an older prepare: "
                f"re-run it (`dvc repro prepare@{d}`)"
            ) from None
    return out


def _note(flagged: dict[str, float], threshold: float) -> str:
    shares = ", ".join(f"{d} {100 * f:.1f}%" for d, f in sorted(flagged.items()))
    return (
        f"{MARK}: the prompt the model sees holds a reference answer for more than {100 * threshold:g}% of "
        f"the questions ({shares}; report.leak_threshold, metrics/prepare/<dataset>.json). The model can "
        "copy the answer, so its samples agree with each other and with the reference whatever it knows: "
        "similarity baselines (lexical similarity, semantic sets, semantic entropy, P_sem) are trivially "
        "strong there, and its figures say little about detecting hallucinations"
    )


def flag_leaks(tables: list[Table], leaks: dict[str, float], threshold: float, models: list[str]) -> list[Table]:
    """Mark, in place, every column headed by a dataset above `threshold` and every row labelled
    "<model> / <dataset> / ..." of one, and add the note to each table so marked."""
    flagged = {d: f for d, f in leaks.items() if f > threshold}
    if not flagged:
        return tables
    for table in tables:
        marked = False
        groups = []
        for heading, cols in table.groups:
            new = [f"{c} {MARK}" if c in flagged else c for c in cols]
            marked |= new != cols
            groups.append((heading, new))
        table.groups = groups
        rows = []
        for row in table.rows:
            parts = row.label.split(" / ")
            if len(parts) > 1 and parts[0] in models and parts[1] in flagged:
                parts[1] = f"{parts[1]} {MARK}"
                row = Row(" / ".join(parts), row.cells, row.rule_before)
                marked = True
            rows.append(row)
        table.rows = rows
        if marked:
            table.notes.append(_note(flagged, threshold))
    return tables

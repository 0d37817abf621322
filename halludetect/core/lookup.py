"""Name lookups with helpful errors, shared by every registry (core/registry.py, methods/, baselines)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from halludetect.core.errors import UserError


class UnknownName(UserError, KeyError):
    """A name that is not registered; the message suggests the closest one and lists all."""

    def __str__(self) -> str:
        return str(self.args[0])


def suggest(name: str, choices: Iterable[str]) -> str:
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ";"
    return f"{hint} valid: {', '.join(choices)}"


def lookup(kind: str, name: str, table: dict):
    if name not in table:
        raise UnknownName(f"unknown {kind} '{name}'{suggest(name, table)}")
    return table[name]

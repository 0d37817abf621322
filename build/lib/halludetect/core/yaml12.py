"""YAML read as DVC reads it: version 1.2 (ruamel.yaml, which DVC itself uses).

Why not PyYAML: it reads YAML 1.1, where the plain words `off`, `on`, `yes`, `no`, `y` and `n` are
booleans and `1:20` is a number. DVC reads and writes params.yaml as YAML 1.2, where they are
strings, and `dvc exp run -S` rewrites the whole file, dropping the quotes of every value 1.2 does
not need quoted: a dataset preset `'no'` (Norwegian's code) comes back as `no`, as the former
`grid.transfer: 'off'` came back `off`. Read with PyYAML, every stage of such an experiment saw
`False`. Reading params the way DVC writes them (and the way it
interpolates `${...}` into dvc.yaml) keeps what the user wrote, quoted or not.

`load` parses text into plain dicts, lists and scalars; a duplicate key is an error (PyYAML kept the
last value silently). Its errors are `YAMLError`, with `problem_mark` (0-based line and column) on
a `MarkedYAMLError`.
"""

from __future__ import annotations

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

__all__ = ["MarkedYAMLError", "YAMLError", "load"]


def load(text: str):
    """The YAML 1.2 document in `text` (None when empty)."""
    return YAML(typ="safe").load(text)  # a YAML object is not reusable across threads: one per call

"""What `dvc exp run -S ...` would make of params.yaml, checked before DVC runs anything.

DVC expands dvc.yaml from params.yaml before any stage runs, and a value it cannot iterate (a word
where `grid.transfer`'s list belongs, say) stops it with "'Value' object is not iterable", naming
no key; a value it can expand but a stage cannot use fails that stage minutes later, or (queued)
in a log nobody reads. `halludetect exp run` (halludetect/cli/exp.py) calls `problems` first: each
run an `exp run` would make (one, or one per point of a `--queue` sweep such as `-S 'a=8,32'`) is
DVC's own edit (`dvc.utils.hydra.apply_overrides`, the function `exp run` applies) made to a copy
of params.yaml and read by the stages' own check (`halludetect.config.load_params`), so a problem
is one line naming the key, the `-S` it came from and what to write, and nothing has run.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

PARAMS = "params.yaml"


def runs(set_params: list[str]) -> list[dict[str, list[str]]]:
    """The runs `dvc exp run -S ...` makes of these values, as DVC groups them: one {params file:
    [overrides]} per run; a sweep (`a=8,32`, `a=range(1,4)`) is one per point, as `--queue` queues
    them (dvc/repo/experiments/run.py). A value Hydra cannot parse is a ValueError saying which."""
    from halludetect.runner.dvc_internals import get_hydra_sweeps, to_hydra_overrides, to_path_overrides

    by_file = to_path_overrides(set_params)
    try:
        sweep = any(o.is_sweep_override() for f in by_file for o in to_hydra_overrides(by_file[f]))
        return get_hydra_sweeps(by_file) if sweep else [by_file]
    except Exception as e:  # noqa: BLE001 - hydra's parse errors have no common base we may rely on
        raise ValueError(f"-S {' -S '.join(set_params)}: DVC cannot read it: {_first_line(e)}") from None


def problems(set_params: list[str], root: Path = Path(".")) -> list[str]:
    """Every problem of params.yaml as each run would see it, one line each (none: all is well)."""
    from halludetect.config import ParamsError, load_params

    params = root / PARAMS
    if not params.is_file():
        return []  # not our repository (DVC says what it says)
    try:
        load_params(params)
    except ParamsError as e:
        return [f"{PARAMS}: {line}" for line in _lines(e, params)]
    try:
        planned = runs(set_params)
    except ValueError as e:
        return [str(e)]
    found: list[str] = []
    with tempfile.TemporaryDirectory(prefix="halludetect-exp-") as tmp:
        for run in planned:
            ours = run.get(PARAMS, [])
            if not ours:
                continue  # another params file's values: our check reads params.yaml only
            copy = Path(tmp) / PARAMS
            given = "-S " + " -S ".join(ours)
            found += [f"{given}: {line}" for line in _check(params, copy, ours)]
    return found


def _check(params: Path, copy: Path, overrides: list[str]) -> list[str]:
    """The problems of params.yaml with these overrides applied (to `copy`)."""
    from halludetect.config import ParamsError, load_params

    shutil.copyfile(params, copy)
    try:
        apply(copy, overrides)
        load_params(copy)
    except ParamsError as e:
        return _lines(e, copy)
    except Exception as e:  # noqa: BLE001 - DVC's own refusal, which names no key when it is unknown
        cause = e.__cause__ or e
        if "Could not override" not in str(cause):
            return [f"DVC cannot apply it to {PARAMS}: {_first_line(cause)}"]
        # a key params.yaml lacks: added as Hydra's `+key=value` would add it, the check names it
        # and the keys it may have meant
        shutil.copyfile(params, copy)
        try:
            apply(copy, [o if o[:1] in "+~" else f"+{o}" for o in overrides])
            load_params(copy)
        except ParamsError as e:
            return _lines(e, copy)
        except Exception:  # noqa: BLE001
            pass
        return [f"{_first_line(cause)} ({PARAMS} has no such key)"]
    return []


def _lines(e: Exception, copy: Path) -> list[str]:
    """A ParamsError's problems without its header line, named as params.yaml."""
    lines = [line.strip() for line in str(e).replace(str(copy), PARAMS).splitlines()]
    return [line for line in lines if line and not re.fullmatch(rf"{re.escape(PARAMS)}: \d+ problem\(s\)", line)]


def apply(path: Path, overrides: list[str]) -> None:
    """DVC's edit of a params file for `-S` (what `dvc exp run` calls)."""
    from halludetect.runner.dvc_internals import apply_overrides

    apply_overrides(str(path), overrides)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]

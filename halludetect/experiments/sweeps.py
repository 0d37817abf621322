"""Sweeps that end in tables: the repository's DVC experiments, read through DVC's Python API,
turned into one table per swept parameter.

    dvc exp run --queue -S 'detectors.max.dim=1,4,16,64,256,1024'   # one experiment per value
    dvc queue start                                                   # runs them (-j N at once)
    halludetect sweep detectors.max.dim        # metrics/sweeps/detectors_max_dim.{md,tex}

Rows are the parameter's values, columns the grid cells (model / dataset), each cell the method's
test metric (mean ± standard error over seeds, at the layer chosen on validation) read from that
experiment's `metrics/eval/<model>/<dataset>/<method>.json`. The committed baseline counts as a
sweep point too. For `detectors.max.dim` the paper's published figure stands beside ours (its D
tables); for `detectors.mean.dim` its mean-pooling figure at D = 256 (it sweeps D for max only).
Nothing here tracks experiments: `dvc exp show`, `dvc exp push`/`pull` and `dvc exp remove`
manage them; this only reads them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from halludetect.core.errors import UserError
from halludetect.report.paper_tables import Grid, sweep_table
from halludetect.report.tables import Table

EVAL = re.compile(r"^(?:.*/)?eval/(?P<model>[^/]+)/(?P<dataset>[^/]+)/(?P<method>[^/]+)\.json:(?P<key>.+)$")
SKIP_STATES = {"Queued", "Running", "Failed"}
META = {"Experiment", "rev", "typ", "Created", "parent", "State", "Executor"}


class SweepError(UserError):
    """A sweep that cannot be tabulated as asked."""


@dataclass
class Experiment:
    name: str  # the experiment's name, or the baseline commit
    params: dict[str, object]  # dotted key -> value
    metrics: dict[tuple[str, str, str], dict]  # (model, dataset, method) -> the metrics JSON, nested again


def _value(v):
    """exp_show's values are floats or strings: integers back to int, JSON lists back to lists."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v[:1] in "[{":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def _nest(flat: dict[str, object]) -> dict:
    out: dict = {}
    for key, v in flat.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = v
    return out


def experiments(repo: str | Path = ".") -> list[Experiment]:
    """The baseline commit and every finished experiment derived from it (`dvc exp show`'s rows),
    newest experiment first; queued, running and failed ones are left out."""
    import dvc.api

    rows = dvc.api.exp_show(repo=str(repo))
    out = []
    for row in rows:
        if row.get("rev") == "workspace" or row.get("State") in SKIP_STATES:
            continue
        params, per_file = {}, {}
        for k, v in row.items():
            if (m := EVAL.match(k)) is not None:
                cell = (m["model"], m["dataset"], m["method"])
                per_file.setdefault(cell, {})[m["key"]] = _value(v)
            elif k not in META and ":" not in k and "/" not in k:  # a param (deps are paths, metrics file:key)
                params[k] = _value(v)
        out.append(
            Experiment(
                row.get("Experiment") or row.get("rev"), params, {cell: _nest(flat) for cell, flat in per_file.items()}
            )
        )
    return out


def method_of(param: str) -> str | None:
    """`detectors.max.dim` sweeps `max`; a parameter outside `detectors` needs --method."""
    parts = param.split(".")
    return parts[1] if parts[0] == "detectors" and len(parts) > 2 else None


def sweep_results(
    exps: list[Experiment], param: str, method: str, where: dict[str, object] | None = None
) -> dict[tuple[str, str], dict]:
    """{(model, dataset): {value: metrics JSON}} of `method` over the experiments that differ in
    `param` only (after `where` picks a slice)."""
    exps = [e for e in exps if all(e.params.get(k) == v for k, v in (where or {}).items())]
    values = {repr(e.params.get(param)) for e in exps}
    if len(values) < 2:
        varied = sorted(
            k for k in {k for e in exps for k in e.params} if len({repr(e.params.get(k)) for e in exps}) > 1
        )
        raise SweepError(
            f"no experiment varies {param} ({len(exps)} experiment(s), all at "
            f"{sorted(values) or 'no value'}); the parameters that vary: {varied or 'none'}. "
            f"Queue a sweep: dvc exp run --queue -S '{param}=1,2,4' && dvc queue start"
        )
    others = sorted(
        k for k in {k for e in exps for k in e.params} - {param} if len({repr(e.params.get(k)) for e in exps}) > 1
    )
    if others:
        raise SweepError(
            f"the experiments vary {others} as well as {param}: one table would mix them. Pick a "
            f"slice with --where KEY=VALUE (e.g. --where {others[0]}="
            f"{exps[0].params.get(others[0])!r})"
        )
    out: dict[tuple[str, str], dict] = {}
    for e in reversed(exps):  # oldest first, so the newest run of a value is the one kept
        for (m, d, meth), metrics in e.metrics.items():
            if meth == method and "test" in metrics:
                out.setdefault((m, d), {})[e.params[param]] = metrics
    if not out:
        raise SweepError(
            f"no experiment has metrics of '{method}' (metrics/eval/<model>/<dataset>/{method}.json): "
            "is it in grid.methods, and did the experiments finish (dvc queue status)?"
        )
    return out


def sweep(
    repo: str | Path,
    param: str,
    grid: Grid,
    *,
    method: str | None = None,
    metric: str = "auroc",
    where: dict[str, object] | None = None,
) -> Table:
    method = method or method_of(param)
    if method is None:
        raise SweepError(f"{param} is not a detector's parameter: say which method's metrics to tabulate (--method)")
    results = sweep_results(experiments(repo), param, method, where)
    cells = {cell for cell in results}
    grid = Grid(
        [m for m in grid.models if any(c[0] == m for c in cells)] or sorted({c[0] for c in cells}),
        [d for d in grid.datasets if any(c[1] == d for c in cells)] or sorted({c[1] for c in cells}),
        grid.model_keys,
        grid.dataset_keys,
    )
    return sweep_table(param, results, grid, metric=metric, name=param.replace(".", "_"))

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

Which experiments: by default those of HEAD and of every commit before it (first parents or
not) that experiments derive from, so that committing after a sweep (a DVC remote, dvc.lock)
does not hide it; `revs` names baseline commits instead, `all_commits` takes every experiment
of the repository, `names` picks experiments by name. Their metrics are read where they are:
the local cache, else the DVC remote the workspace configures *now* (DVC would look for a
remote in each experiment's own commit, which has none when the remote was configured after the
sweep). So a colleague needs the experiments' git refs only (`dvc exp pull origin -A
--no-cache`): the table streams the few metrics files it needs and fetches nothing else.

Every experiment of the parameter is in the table: one that failed is a row marked `failed`,
with the first line of its error from the queue's log in the notes (`dvc queue logs NAME` has
all of it); one still queued or running is a row marked so; one whose metrics are recorded in
its commit but neither in the cache nor on the remote is a row marked `missing`, with what to
run; one whose git ref cannot be read (halludetect/experiments/refs.py) is a note naming the ref
and why, and is kept from DVC, which would walk the whole history for a ref at its own baseline.
The parameter, the `--where` keys, the method, the metric, the revisions and the
experiment names are checked against what exists, each a `SweepError` naming the valid ones.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from halludetect.core.errors import UserError
from halludetect.core.lookup import suggest
from halludetect.experiments.refs import ExpRef, exp_refs
from halludetect.report.cells import Grid
from halludetect.report.sweep_tables import sweep_table
from halludetect.report.tables import Table

# evaluate's outputs; metrics/eval/<model>/transfer/ holds the transfer stage's (no dataset is named so)
EVAL = re.compile(r"^metrics/eval/(?P<model>[^/]+)/(?P<dataset>(?!transfer/)[^/]+)/(?P<method>[^/]+)\.json$")
UNFINISHED = {"Queued": "queued", "Running": "running", "Failed": "failed"}  # exp_show's State -> the table's mark
META = {"Experiment", "rev", "typ", "Created", "parent", "State", "Executor"}


class SweepError(UserError):
    """A sweep that cannot be tabulated as asked."""


@dataclass
class Experiment:
    name: str  # the experiment's name, or the baseline commit
    params: dict[str, object]  # dotted key -> value
    metrics: dict[tuple[str, str, str], dict]  # (model, dataset, method) -> its metrics/eval JSON
    state: str | None = None  # None: finished (or the baseline); else "failed", "queued", "running" or "unreadable"
    error: str | None = None  # a failed experiment's first error line, from its queue log; why a ref is unreadable
    rev: str | None = None  # its commit (short sha), to find what its dvc.lock records
    unread: dict[str, str] | None = None  # evaluation files its dvc.lock records that could not be read: why


def first_error(log: str) -> str | None:
    """The line of a failed experiment's log that says why: a stage's own `error: ...` line (bad
    input), else the last line of a Python traceback, else DVC's first `ERROR: ...`."""
    raw = [line.rstrip() for line in log.splitlines() if line.strip()]
    for i, line in enumerate(raw):
        if line.startswith("error: "):
            # a message listing its problems on indented lines below ("params.yaml: 1 problem(s)"): the first one too
            more = raw[i + 1].strip() if i + 1 < len(raw) and raw[i + 1][:1].isspace() else ""
            return line[len("error: ") :] + (f" {more}" if more else "")
    lines = [line.strip() for line in raw]
    dvc_error = next((i for i, line in enumerate(lines) if line.startswith("ERROR: ")), None)
    if dvc_error is None:
        return lines[-1] if lines else None
    if dvc_error > 0 and any(line.startswith("Traceback (most recent call last)") for line in lines[:dvc_error]):
        return lines[dvc_error - 1]  # e.g. "ValueError: ...", just before DVC reports the stage failed
    return lines[dvc_error][len("ERROR: ") :]


def queue_errors(repo: str | Path) -> dict[str, str]:
    """{experiment name and stash rev: first error line} of the failed experiments of DVC's queue."""
    from halludetect.runner.dvc_internals import Repo

    out = {}
    with Repo(str(repo)) as r:
        queue = r.experiments.celery_queue
        for entry, _ in queue.iter_failed():
            info = queue.proc.get(entry.stash_rev)
            try:
                text = Path(info.stdout).read_text(errors="replace") if info and info.stdout else ""
            except OSError:
                text = ""
            line = first_error(text) or "no log (it failed while DVC set it up; see `dvc queue logs`)"
            for key in (entry.name, entry.stash_rev, entry.stash_rev[:7]):
                if key:
                    out[key] = line
    return out


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


def _git(repo: str | Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def baselines(
    repo: str | Path,
    revs: list[str] | None = None,
    all_commits: bool = False,
    names: list[str] | None = None,
    refs: list[ExpRef] | None = None,
) -> list[str]:
    """The commits whose experiments to read, HEAD's first (full shas).

    `names`: the baselines of those experiments. `revs`: those commits. `all_commits`: HEAD and
    the baseline of every experiment the repository holds. Otherwise: HEAD and the baselines
    that are ancestors of HEAD, which is what a sweep committed over (a remote, dvc.lock) needs.
    Queued, running and failed experiments count by the commit they were queued on. `refs`: the
    clone's experiment refs, as `exp_refs` read them (read here when not given)."""
    from halludetect.runner.dvc_internals import Repo

    refs = exp_refs(repo) if refs is None else refs
    with Repo(str(repo)) as r:
        head = r.scm.get_rev()
        if names:
            if missing := sorted(n for n in names if not any(ref.name == n for ref in refs)):
                known = sorted({ref.name for ref in refs})
                hint = suggest(missing[0], known) if known else ": this clone has no experiments"
                raise SweepError(
                    f"no experiment named {', '.join(missing)}{hint}. A colleague's experiments come with "
                    "`dvc exp pull origin -A --no-cache`"
                )
            named = dict.fromkeys(ref.baseline for ref in refs if ref.name in names and ref.baseline)
            return [b for b in named if _git(repo, "cat-file", "-e", f"{b}^{{commit}}").returncode == 0]
        if revs:
            out = []
            for rev in revs:
                res = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
                if res.returncode:
                    raise SweepError(f"--rev {rev}: no such commit in this clone (a branch, tag or sha)")
                out.append(res.stdout.strip())
            return list(dict.fromkeys(out))
        bases = {ref.baseline for ref in refs if ref.baseline}
        queue = r.experiments.celery_queue
        for entries in (queue.iter_queued(), queue.iter_active(), (e for e, _ in queue.iter_failed())):
            bases |= {e.baseline_rev for e in entries if e.baseline_rev}
    bases.discard(head)
    # a baseline this clone lacks (a damaged ref's) has no experiments to read; its refs are reported
    bases = {b for b in bases if _git(repo, "cat-file", "-e", f"{b}^{{commit}}").returncode == 0}
    if not all_commits:
        bases = {b for b in bases if _git(repo, "merge-base", "--is-ancestor", b, head).returncode == 0}
    # newest baseline first, as exp_show lists HEAD's
    dated = {b: _git(repo, "show", "-s", "--format=%ct", b).stdout.strip() for b in bases}
    return [head, *sorted(bases, key=lambda b: (dated[b], b), reverse=True)]


def experiments(
    repo: str | Path = ".",
    revs: list[str] | None = None,
    all_commits: bool = False,
    names: list[str] | None = None,
) -> list[Experiment]:
    """Every baseline commit of `baselines()` and the experiments derived from it (`dvc exp
    show`'s rows), newest first. Queued, running and failed ones come with their state and no
    metrics (exp_show gives a failed experiment the baseline's); failed ones with their first
    error line. Metrics that are not in the local cache are read from the workspace's DVC remote.
    An experiment whose ref cannot be read (damaged, a commit this clone lacks, a tree, its
    baseline itself) comes last, marked `unreadable`, with the problem and the fix as its error."""
    from halludetect.experiments.sharing import workspace_remotes

    refs = exp_refs(repo)
    bases = baselines(repo, revs, all_commits, names, refs)
    remotes = workspace_remotes(repo)
    # DVC sees the readable refs only: it walks a ref's first parents until the baseline, which a ref
    # pointing at its baseline never meets (the whole history, read commit by commit), and a damaged
    # ref is dropped silently or a traceback, depending on which git library DVC tries first
    rows = _exp_show(repo, bases, remotes, {ref.ref for ref in refs if ref.problem})
    sections = _param_sections(repo)
    errors = queue_errors(repo) if any(row.get("State") == "Failed" for row in rows) else {}
    cache = local_cache(repo)
    out = []
    for row in rows:
        if row.get("rev") == "workspace":
            continue
        if names and row.get("typ") != "baseline" and row.get("Experiment") not in names:
            continue
        state = UNFINISHED.get(row.get("State"))
        params = {}
        for k, v in row.items():
            if k.startswith("params.yaml:"):  # a param whose name a metric shares
                params[k.removeprefix("params.yaml:")] = _value(v)
            elif k not in META and ":" not in k and "/" not in k and k.split(".")[0] in sections:
                # a param: deps are paths, and a metric is `file:key`, or its bare key where no other
                # file has it (the headline files' `test.auroc...`), which no params.yaml section starts
                params[k] = _value(v)
        name = row.get("Experiment") or row.get("rev")
        error = None
        if state == "failed":
            error = errors.get(name) or errors.get(row.get("rev")) or "no log found (see `dvc queue logs`)"
        metrics, unread = ({}, {}) if state or not row.get("rev") else evaluations(repo, row["rev"], remotes, cache)
        out.append(Experiment(name, params, metrics, state, error, row.get("rev"), unread))
    for ref in refs:  # a named one is reported even when its baseline is not in this clone
        if ref.problem and (ref.name in names if names else ref.baseline in bases):
            out.append(Experiment(ref.name, {}, {}, "unreadable", ref.problem))
    return out


def _exp_show(repo: str | Path, revs: list[str], config: dict | None, hidden: set[str]) -> list[dict]:
    """`dvc.api.exp_show(repo, revs, config=config)` with the experiment refs `hidden` out of
    DVC's sight. (exp_show's `refs` filter cannot do it: DVC 3.67 keeps the first ref of each
    baseline only.)"""
    from halludetect.runner.dvc_internals import (
        Repo,
        _postprocess,  # the API's own conversion of the table's values
        tabulate,
    )

    with Repo.open(str(repo), config=config) as r:
        listed = r.scm.iter_refs  # DVC lists a baseline's experiments through this repository's scm
        r.scm.iter_refs = lambda base=None: (ref for ref in listed(base=base) if ref not in hidden)
        states = r.experiments.show(revs=revs, num=1)
        table, _ = tabulate(states, fill_value=None)
        return _postprocess(table.as_dict())


def recorded_evaluations(repo: str | Path, rev: str) -> dict[str, str | None]:
    """The evaluation files (metrics/eval/<model>/<dataset>/<method>.json) that the commit's
    dvc.lock records, with the md5 it records for each (None where it has none)."""
    import yaml

    res = _git(repo, "show", f"{rev}:dvc.lock")
    if res.returncode:
        return {}
    # libyaml's loader where PyYAML has it: the same values, and 10 times faster on a lock of a few
    # hundred stages (4 loads of the tests' 65 KB lock: 0.06 s against 0.37 s with PyYAML's own parser)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    stages = (yaml.load(res.stdout, Loader=loader) or {}).get("stages", {})
    outs = [o for st in stages.values() for o in st.get("outs", []) if isinstance(o, dict)]
    evals = [o for o in outs if EVAL.match(str(o.get("path", "")))]
    return {o["path"]: o.get("md5") for o in sorted(evals, key=lambda o: o["path"])}


def local_cache(repo: str | Path):
    """The repository's local DVC cache (its `oid_to_path`), wherever `cache.dir` puts it; None where
    DVC cannot say."""
    from halludetect.runner.dvc_internals import Repo

    try:
        with Repo(str(repo)) as r:
            return r.cache.local
    except Exception:  # noqa: BLE001 - then every file is read through DVC's filesystem, as before
        return None


def evaluations(repo: str | Path, rev: str, remotes: dict | None, cache=None) -> tuple[dict, dict[str, str]]:
    """The evaluation files a commit records: from the local `cache` by the md5 its dvc.lock records,
    else through DVC's filesystem at that commit, which reads the local cache or the DVC remote the
    workspace configures (`remotes`, streamed: nothing lands in the cache). Opening that filesystem
    costs about 0.5 s a commit (DVC builds the commit's index), so it is opened only for a file the
    cache lacks. ({(model, dataset, method): the metrics JSON}, {path: why it could not be read})."""
    recorded = recorded_evaluations(repo, rev)
    found: dict[tuple[str, str, str], dict] = {}
    unread: dict[str, str] = {}
    fs = None
    for path, md5 in recorded.items():
        m = EVAL.match(path)
        local = Path(cache.oid_to_path(md5)) if cache is not None and md5 else None
        try:
            if local is not None and local.is_file():
                found[(m["model"], m["dataset"], m["method"])] = json.loads(local.read_text())
                continue
            if fs is None:
                from halludetect.runner.dvc_internals import DVCFileSystem

                fs = DVCFileSystem(str(repo), rev=rev, config=remotes)
            found[(m["model"], m["dataset"], m["method"])] = json.loads(fs.read_text(path))
        except Exception as e:  # noqa: BLE001 - not in the cache nor on the remote, or the remote unreachable: the row says so
            unread[path] = f"{type(e).__name__}: {e}"
    return found, unread


def _param_sections(repo: str | Path) -> set[str]:
    """The top-level sections of the repository's params.yaml (grid, train, detectors, ...)."""
    import yaml

    path = Path(repo) / "params.yaml"
    return set(yaml.safe_load(path.read_text()) or {}) if path.exists() else set()


def _flatten(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in tree.items():
        key = f"{prefix}{k}"
        keys |= _flatten(v, f"{key}.") if isinstance(v, dict) and v else {key}
    return keys


def check_param(param: str, params: dict, what: str = "the swept parameter") -> None:
    """`param` must be a key of the params file (`params`, as loaded from YAML), a leaf of it."""
    keys = _flatten(params)
    if param in keys:
        return
    section, prefix = param, ""
    while "." in section:  # the deepest section of params.yaml that the key is written under
        section = section.rsplit(".", 1)[0]
        if any(k.startswith(f"{section}.") for k in keys):
            prefix = f"{section}."
            break
    siblings = sorted(k for k in keys if k.startswith(prefix) and "." not in k[len(prefix) :]) if prefix else []
    close = difflib.get_close_matches(param, sorted(keys), n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    valid = f" The keys of {section}: {', '.join(siblings)}" if siblings else ""
    raise SweepError(f"{what} {param} is not a parameter of params.yaml{hint}{valid}")


def method_of(param: str) -> str | None:
    """`detectors.max.dim` sweeps `max`; a parameter outside `detectors` needs --method."""
    parts = param.split(".")
    return parts[1] if parts[0] == "detectors" and len(parts) > 2 else None


def sweep_results(
    exps: list[Experiment], param: str, method: str, where: dict[str, object] | None = None
) -> tuple[dict[tuple[str, str], dict], list[Experiment]]:
    """{(model, dataset): {value: metrics JSON}} of `method` over the experiments that differ in
    `param` only (after `where` picks a slice), and the experiments of the slice with no metrics
    of `method` (failed, queued, running, or finished without them)."""
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
    without = []
    for e in reversed(exps):  # oldest first, so the newest run of a value is the one kept
        found = False
        for (m, d, meth), metrics in e.metrics.items():
            if meth == method and isinstance(metrics.get("test"), dict):
                out.setdefault((m, d), {})[e.params.get(param)] = metrics
                found = True
        if not found:
            without.append(e)
    if not out:
        states = ", ".join(f"{e.name}: {e.state or 'no metrics'}" for e in without)
        raise SweepError(
            f"no experiment has metrics of '{method}' (metrics/eval/<model>/<dataset>/{method}.json): "
            f"is it in grid.detectors, and did the experiments finish (dvc queue status)? ({states})"
        )
    return out, list(reversed(without))


def unfinished_rows(without: list[Experiment], param: str, done: set) -> tuple[dict, list[str]]:
    """The table's marks for values without results ({value: "failed" | "queued" | "running" |
    "missing" | "no metrics"}) and one note per such experiment, with a failed one's first error
    line and what to run for missing metrics."""
    marks, notes = {}, []
    for e in without:
        value, state = e.params.get(param), e.state or "no metrics"
        if value not in done:
            marks.setdefault(value, state)
        if state == "failed":
            notes.append(f"{param}={value}: experiment {e.name} failed: {e.error} (`dvc queue logs {e.name}`)")
        elif state == "missing":
            notes.append(f"{param}={value}: experiment {e.name}'s metrics are missing: {e.error}")
        elif state in ("queued", "running"):
            notes.append(f"{param}={value}: experiment {e.name} is {state}: run this again once it has finished")
        else:
            notes.append(f"{param}={value}: experiment {e.name} finished without this method's metrics")
    return marks, notes


def valid_metrics(results: dict[tuple[str, str], dict]) -> set[str]:
    """The test metrics the experiments' metrics files hold (those with a mean over seeds)."""
    return {
        k
        for per_cell in results.values()
        for metrics in per_cell.values()
        for k, v in metrics["test"].items()
        if isinstance(v, dict) and "mean" in v
    }


def sweep(
    repo: str | Path,
    param: str,
    grid: Grid,
    *,
    method: str | None = None,
    metric: str = "auroc",
    where: dict[str, object] | None = None,
    params: dict | None = None,
    revs: list[str] | None = None,
    all_commits: bool = False,
    names: list[str] | None = None,
) -> Table:
    """One table of `method`'s test `metric` along `param` over the repository's experiments
    (`revs`, `all_commits`, `names`: which ones, as in `experiments()`). `params` (the params
    file as loaded from YAML) checks that `param` and the `where` keys exist."""
    from halludetect.methods import METHODS

    if params is not None:
        check_param(param, params)
        for key in where or {}:
            check_param(key, params, "--where")
    method = method or method_of(param)
    if method is None:
        raise SweepError(f"{param} is not a detector's parameter: say which method's metrics to tabulate (--method)")
    if method not in METHODS:
        raise SweepError(f"unknown method '{method}'{suggest(method, METHODS)}")
    exps = experiments(repo, revs, all_commits, names)
    # an experiment whose ref cannot be read has no params to place it by: a note, never silence
    unreadable = [f"experiment {e.name} is not in the table: {e.error}" for e in exps if e.state == "unreadable"]
    try:
        results, without = sweep_results([e for e in exps if e.state != "unreadable"], param, method, where)
    except SweepError as err:
        if not unreadable:
            raise
        raise SweepError(f"{err}. And {len(unreadable)} could not be read: {'; '.join(unreadable)}") from None
    for e in without:
        if e.state is None and (paths := [p for p in e.unread or {} if EVAL.match(p)["method"] == method]):
            e.state, e.error = "missing", missing_metrics_advice(repo, paths)
    if metric not in (have := valid_metrics(results)):
        raise SweepError(f"--metric '{metric}' is not a test metric of '{method}'{suggest(metric, have)}")
    done = {v for per_cell in results.values() for v in per_cell}
    marks, notes = unfinished_rows(without, param, done)
    cells = {cell for cell in results}
    grid = Grid(
        [m for m in grid.models if any(c[0] == m for c in cells)] or sorted({c[0] for c in cells}),
        [d for d in grid.datasets if any(c[1] == d for c in cells)] or sorted({c[1] for c in cells}),
        grid.model_keys,
        grid.dataset_keys,
    )
    table = sweep_table(param, results, grid, metric=metric, name=param.replace(".", "_"), marks=marks)
    table.notes += notes + unreadable
    return table


def missing_metrics_advice(repo: str | Path, paths: list[str]) -> str:
    """Why an experiment's recorded metrics could not be read, and what to run."""
    from halludetect.experiments.sharing import workspace_remotes

    remotes = workspace_remotes(repo)
    files = ", ".join(paths)
    if remotes is None:
        return (
            f"its dvc.lock records {files}, which is not in the local cache, and this clone configures no DVC "
            "remote to read it from: configure the team's (`dvc remote add -d NAME URL`, or pull the commit "
            "that does), then run this again"
        )
    name = remotes.get("core", {}).get("remote") or ", ".join(remotes["remote"])
    return (
        f"its dvc.lock records {files}, which is neither in the local cache nor on the DVC remote '{name}': "
        "whoever ran the experiment pushes its outputs with `halludetect exp-push origin` "
        "(docs/sweeps-and-sharing.md)"
    )

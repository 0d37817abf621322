"""`halludetect repro`: `dvc repro` with a progress line a newcomer can follow.

`dvc repro` prints `Running stage '...'` and the stages' own output, and nothing says how far the
run is or how long is left (an hour on two cores for the paper's protocol on the demo world). This
runs the same `dvc repro` (every argument passed through) and, as each stage starts, prints

    [stage 17 of 84 (12 to run) | 00:12:31 elapsed | about 00:08:10 left]

How it knows: first DVC's own plan for the same arguments and each stage's check (`plan`: a few
seconds, as `dvc status`), which give the stages DVC will visit, in order, and whether each runs or
is unchanged; an upstream stage whose outputs come out the same makes a planned downstream stage
skip, so "to run" is an upper bound. "Left" adds, for each stage still to run, its duration
in the last run that ran it (kept in `.dvc/tmp/halludetect-stage-seconds.json`, DVC's own scratch
directory, ignored by git), else the median of this run's stages of its family (the name before
`@`), else of all this run's stages; it is blank until something is known. Every byte DVC and the
stages write passes through unchanged, on stdout (DVC's stderr joined to it so that their order
is kept), and the exit status is DVC's.

`-j N` / `--jobs N` (the one argument that is not DVC's) runs up to N independent stages at once
(runner/parallel_repro.py); each stage's end is then a line of its own, which gives its time, and
"left" divides the work still expected among the N.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# DVC's own lines as a stage starts, or is skipped (unchanged, or restored from its run cache)
VISIT = re.compile(r"^(?:Running stage '(?P<run>[^']+)':|Stage '(?P<skip>[^']+)' (?:didn't change|is cached))")
# what --jobs N > 1 prints as a stage ends (runner/parallel_repro.py): stages end in no fixed order
FINISHED = re.compile(r"^Finished stage '(?P<stage>[^']+)' in (?P<seconds>[0-9.]+) s$")
# `dvc exp run --run-all` follows each queued experiment's log in turn: the count starts again
EXPERIMENT = re.compile(r"^Reproducing experiment '(?P<name>[^']+)'")
HISTORY = Path(".dvc/tmp/halludetect-stage-seconds.json")
JOBS_ENV = "HALLUDETECT_REPRO_JOBS"  # read by runner/dvc_lock.py, which runs DVC


def dvc(*args: str) -> list[str]:
    """The command running this environment's DVC (the one on PATH may be another's), with dvc.lock
    written entry by entry (runner/dvc_lock.py: the same bytes, a rewrite in O(one stage))."""
    return [sys.executable, "-m", "halludetect.runner.dvc_lock", *args]


def plan(
    args: list[str], command: tuple[str, ...] = ("repro",), set_params: list[str] = ()
) -> list[tuple[str, str]] | None:
    """[(stage, what happens to it)] in the order `dvc <command> args` visits the stages: "run" (its
    command runs), "restore" (DVC's run cache has its outputs for the dependencies it will see: DVC
    checks them out, "Stage ... is cached") or "skip" (unchanged); None when it cannot be told (DVC's
    run then prints why). DVC's own steps: its argument parser, stage collection and plan
    (dvc/repo/reproduce.py), then each stage's `changed()`, the check the run makes, and the run
    cache's lookup (dvc/stage/cache.py), which DVC makes before it runs a changed stage. A stage
    downstream of one that runs is counted as running (an upper bound: its outputs are not known
    until then); one downstream of restored stages is looked up with the restored outputs.
    `set_params`: `exp run`'s -S values, applied to params.yaml for the plan (DVC's own edit) and
    undone after. (`dvc repro --dry` cannot plan a fresh clone: it hashes the dependencies that
    upstream stages have not written yet.)"""
    from halludetect.runner.dvc_internals import (
        PROJECT_FILE,
        Repo,
        collect_stages,
        get_active_graph,
        parse_args,
        plan_repro,
    )

    try:
        ns = parse_args([*command, *args])
        with _applied(set_params), _quiet_dvc(), Repo() as repo, repo.lock:
            opt = vars(ns).get  # exp run's parser lacks some of repro's options (--glob)
            whole = opt("pipeline") or opt("all_pipelines")
            targets = opt("targets") or [PROJECT_FILE]
            stages = [] if opt("all_pipelines") else collect_stages(repo, targets, opt("recursive"), opt("glob"))
            graph = get_active_graph(repo.index.graph)  # an edge runs from a stage to a stage it reads from
            steps = stages if opt("single_item") and not whole else plan_repro(graph, stages, whole, opt("downstream"))
            run_cache = not (opt("force") or opt("no_run_cache"))
            fate: dict = {}
            known: dict = {}  # an output's path -> (hash_info, meta) it will have: restored, or predicted
            for stage in steps:
                upstream = {fate[u] for u in graph.successors(stage) if u in fate}
                if opt("force") or "run" in upstream:
                    fate[stage] = "run"  # an upper bound: what an upstream command writes is not known
                    continue
                changed = _changed_given(stage, known) if upstream & {"restore", "predicted"} else stage.changed()
                if changed is False and _params_files_missing(stage, steps):
                    fate[stage] = "force"  # a stage new to dvc.yaml: its params file is not written yet
                elif changed is False:
                    fate[stage] = "skip"
                elif changed and run_cache and _restorable(repo, stage, known):
                    fate[stage] = "restore"
                elif changed and _predicted(stage, known, repo.index.stages):
                    fate[stage] = "predicted"
                else:
                    fate[stage] = "run"
            return [(stage.addressing, "run" if f == "predicted" else f) for stage, f in fate.items()]
    except (Exception, SystemExit):  # noqa: BLE001 - a broken dvc.yaml, an unknown target: DVC's run says so
        return None


def _params_files_missing(stage, steps) -> bool:
    """Whether `stage` is the params stage and a stage of the run lacks its params file: a stage added
    to dvc.yaml since the params stage last ran (DVC cannot track dvc.yaml itself, so nothing tells
    it to run again: runner/params_digests.py). `halludetect repro` then runs it first, forced."""
    if "stages.params" not in (stage.cmd or "") or len(stage.outs) != 1:
        return False
    out = os.path.normpath(stage.outs[0].fs_path)
    return any(
        os.path.normpath(d.fs_path).startswith(out + os.sep) and not os.path.exists(d.fs_path)
        for s in steps
        for d in s.deps
    )


def _changed_given(stage, known: dict) -> bool | None:
    """`stage.changed()` when the outputs in `known` are what its dependencies will hold (None: not
    to be told, a dependency holds a known output or lies inside one it cannot be looked up in)."""
    try:
        if stage.changed_stage() or stage.changed_outs():
            return True
        for dep in stage.deps:
            given = _given(dep, known)
            if given is None:
                if dep.changed():
                    return True
            elif given is False:
                return None
            elif given[0] != dep.hash_info:
                return True
        return False
    except Exception:  # noqa: BLE001 - DVC internals: a doubt is "not to be told"
        return None


def _given(dep, known: dict):
    """(hash_info, meta) that `dep` will hold from `known`; None when it holds no known output;
    False when it contains one (a directory over a known file: not worked out here)."""
    path = os.path.normpath(dep.fs_path)
    if path in known:
        return known[path]
    if any(p.startswith(path + os.sep) for p in known):
        return False
    return None


def _restorable(repo, stage, known: dict) -> bool:
    """Whether DVC's run cache holds `stage`'s outputs for the dependencies it will have: the
    workspace's, or those upstream stages will write (`known`; a restored stage's outputs are added
    to it). DVC's `StageCache.restore` without its checkout; any doubt is "no", so the plan stays an
    upper bound."""
    from halludetect.runner.dvc_internals import _can_hash, _get_cache_hash, to_single_stage_lockfile

    try:
        for dep in stage.deps:
            given = _given(dep, known)
            if given is False:
                return False
            if given is None:
                dep.save()
            else:
                dep.hash_info, dep.meta = given
        if not _can_hash(stage):
            return False
        key = _get_cache_hash(to_single_stage_lockfile(stage), key=True)
        entries = Path(repo.stage_cache._get_cache_dir(key))
        if not entries.is_dir():
            return False
        newest = max(entries.iterdir(), key=lambda p: p.stat().st_mtime, default=None)
        cache = newest and repo.stage_cache._load_cache(key, newest.name)
        if not cache:
            return False
        cached = repo.stage_cache._create_stage(cache, wdir=stage.wdir)
        if not cached.outs_cached():
            return False
        for out in cached.outs:
            known[os.path.normpath(out.fs_path)] = (out.hash_info, out.meta)
            if out.hash_info.isdir:  # its files too, which stages list one by one (data/code/<stage>.txt)
                tree = out.get_obj()
                for parts, meta, hash_info in tree or ():
                    known[os.path.normpath(os.path.join(out.fs_path, *parts))] = (hash_info, meta)
    except Exception:  # noqa: BLE001 - DVC internals: a doubt is "it runs"
        return False
    return True


def _predicted(stage, known: dict, stages=()) -> bool:
    """The code and params stages' outputs are pure functions of the code, params.yaml and dvc.yaml,
    computed in a second (core/code_deps.py, runner/params_digests.py): worked out here, so that an
    experiment that changes a parameter does not count every stage below them as running, only the
    stages whose digest or params file changes. `stages`: DVC's resolved stages (the params stage's keys)."""
    from halludetect.core import code_deps
    from halludetect.runner import params_digests

    if len(stage.outs) != 1 or stage.outs[0].hash_name != "md5":
        return False
    out = stage.outs[0]
    try:
        if stage.addressing == code_deps.CODE_STAGE and "stages.code" in (stage.cmd or ""):
            found = code_deps.digests()
        elif "stages.params" in (stage.cmd or ""):
            root = stage.repo.root_dir
            found = params_digests.texts(stages, root, os.path.relpath(out.fs_path, root).replace(os.sep, "/"))
        else:
            return False
    except Exception:  # noqa: BLE001 - the stage itself will say what is wrong
        return False
    import hashlib

    from halludetect.runner.dvc_internals import HashInfo, Meta

    for rel, text in found.items():
        data = text.encode()
        path = os.path.normpath(os.path.join(out.fs_path, *rel.split("/")))
        known[path] = (HashInfo("md5", hashlib.md5(data).hexdigest()), Meta(size=len(data)))
    return True


@contextlib.contextmanager
def _applied(set_params):
    """params.yaml with `dvc exp run -S` values applied as DVC applies them, its bytes put back after."""
    if not set_params:
        yield
        return
    from halludetect.runner.dvc_internals import apply_overrides, to_path_overrides

    path = Path("params.yaml")
    before = path.read_bytes()
    try:
        apply_overrides(str(path), to_path_overrides(set_params).get(path.name, []))
        yield
    finally:
        if path.read_bytes() != before:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(before)
            os.replace(tmp, path)


@contextlib.contextmanager
def _quiet_dvc():
    """DVC's info lines off while planning (the run cache's lookup logs "is cached" as if it ran)."""
    import logging

    log = logging.getLogger("dvc")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


JOBS_HELP = """  -j N, --jobs N        run up to N stages at once, each as soon as the stages it
                        reads from have ended ('auto': one per core this process
                        may use; default 1, DVC's one at a time). Same outputs
                        and dvc.lock; timings measured beside other stages
                        (docs/pipeline.md#stages-side-by-side)"""


def split_jobs(args: list[str]) -> tuple[list[str], int]:
    """(dvc repro's arguments, the stage count of -j/--jobs) from `halludetect repro`'s; DVC's repro
    has no -j. A bad count is a ValueError naming it."""
    from halludetect.runner.parallel_repro import jobs_from

    rest, value, i = [], "1", 0
    while i < len(args):
        a = args[i]
        if a in ("-j", "--jobs"):
            if i + 1 >= len(args):
                raise ValueError(f"{a} needs a count of stages at once (or 'auto')")
            value, i = args[i + 1], i + 2
            continue
        if a.startswith("--jobs="):
            value = a.split("=", 1)[1]
        elif a.startswith("-j") and len(a) > 2 and not a.startswith("--"):
            value = a[2:]
        else:
            rest.append(a)
        i += 1
    return rest, jobs_from(value)


def hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """The stages of one run: which one is current, how long each took, what is left."""

    def __init__(self, planned: list[tuple[str, bool]] | None, history: dict[str, float], start: float):
        self.planned, self.history = planned or [], history
        self.known = planned is not None
        self.to_run = [s for s, runs in self.planned if runs]
        self.start = start  # time.monotonic() when the command started (the dry run counts)
        self.seen: set[str] = set()
        self.seconds: dict[str, float] = {}  # stages of this run that finished
        self.ran = 0  # how many finished (`--run-all` runs a stage once per experiment)
        self.current: tuple[str, float] | None = None
        self.started = 0  # stages DVC ran so far
        self.jobs = 1  # stages at once; above 1 each stage's end is a line of its own (`end`)
        self.running: dict[str, float] = {}  # with jobs > 1: the stages started and not ended

    def visit(self, stage: str, runs: bool) -> str | None:
        """The progress line for a stage DVC starts (None for one it skips: DVC's line says so);
        finishes the previous one (one stage at a time)."""
        if self.jobs == 1:
            self.finish()
        self.seen.add(stage)
        if not runs:
            return None
        if self.jobs == 1:
            self.current = (stage, time.monotonic())
        else:
            self.running[stage] = time.monotonic()
        self.started += 1
        left = self.left() if self.known else None
        eta = f" | about {hms(left)} left" if left is not None else ""
        of = f" of {max(len(self.to_run), self.started)}" if self.known else ""
        visited = f"stage {len(self.seen)} of {len(self.planned) or '?'}"
        return f"[running {self.started}{of} | {visited} | {hms(time.monotonic() - self.start)} elapsed{eta}]"

    def end(self, stage: str, seconds: float) -> None:
        """A stage run beside others ended, after `seconds` (its own count)."""
        self.running.pop(stage, None)
        self.seconds[stage] = seconds
        self.ran += 1

    def finish(self) -> None:
        if self.current is not None:
            stage, t0 = self.current
            self.seconds[stage] = time.monotonic() - t0
            self.ran += 1
            self.current = None

    def expected(self, stage: str) -> float | None:
        if stage in self.history:
            return self.history[stage]
        family = [t for s, t in self.seconds.items() if s.split("@")[0] == stage.split("@")[0]]
        pool = family or list(self.seconds.values())
        return statistics.median(pool) if pool else None

    def left(self) -> float | None:
        """Seconds expected for the planned stages not started yet, plus the rest of the running
        ones; with jobs > 1 that work divided among the jobs (a rough figure: a stage may use more
        than one core, and what depends on what leaves slots idle)."""
        pending = [s for s in self.to_run if s not in self.seen]
        total = 0.0
        for stage in pending:
            t = self.expected(stage)
            if t is None:
                return None
            total += t
        running = dict(self.running)
        if self.current is not None:
            running[self.current[0]] = self.current[1]
        for stage, t0 in running.items():
            if (t := self.expected(stage)) is None:
                return None  # a stage now running: nothing known of it yet (not "0 left")
            total += max(0.0, t - (time.monotonic() - t0))
        return total / self.jobs


def read_history(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: the estimate starts from this run's own stages
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def write_history(path: Path, history: dict[str, float]) -> None:
    if not path.parent.is_dir():
        return  # not a DVC repository's root: nothing to keep
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(history, indent=1, sort_keys=True))
    os.replace(tmp, path)


def main(
    args: list[str],
    why_unplannable: Callable[[], str | None] | None = None,
    command: tuple[str, ...] = ("repro",),
    set_params: list[str] = (),
    jobs_are_ours: bool = True,
) -> int:
    """Run `dvc <command> args` (`dvc repro`, or `dvc exp run` for cli/exp.py) with the progress
    lines; returns DVC's exit status. `why_unplannable`: asked when DVC cannot plan the run, it may
    name the cause (the CLI passes the params check); then that is printed and nothing runs (exit
    status 2). `set_params`: exp run's -S values, which the plan applies as DVC will.
    `jobs_are_ours`: -j is stages at once (else it is DVC's own option, passed on)."""
    name = " ".join(command)
    if {"-h", "--help"} & set(args):
        print(__doc__.split("\n\n")[0] + f" Every argument but one is dvc {name}'s:\n\n{JOBS_HELP}\n", flush=True)
        return subprocess.run(dvc(*command, "--help")).returncode
    jobs = 1
    if jobs_are_ours:
        try:
            args, jobs = split_jobs(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    start = time.monotonic()
    fates = plan(args, command, set_params) if command == ("repro",) or jobs_are_ours else None
    forced = [stage for stage, fate in fates or () if fate == "force"] if command == ("repro",) else []
    fates = fates and [(stage, "run" if fate == "force" else fate) for stage, fate in fates]
    planned = None if fates is None else [(stage, fate == "run") for stage, fate in fates]
    if fates is None and why_unplannable is not None and (problem := why_unplannable()):
        # DVC could not even expand the stages (a matrix over a value that is no list, say): its own
        # error would be "'Value' object is not iterable"; the params check says which key and why
        print(f"error: {problem}", file=sys.stderr)
        return 2
    history = read_history(HISTORY)
    progress = Progress(planned, history, start)
    progress.jobs = jobs
    if fates is not None:
        counts = {f: sum(1 for _, x in fates if x == f) for f in ("run", "restore", "skip")}
        restore = f", {counts['restore']} from the run cache" if counts["restore"] else ""
        head = f"dvc {name} {' '.join(args)}".rstrip()
        print(f"{head}: {len(fates)} stages, {counts['run']} to run{restore}, {counts['skip']} unchanged", flush=True)
    for stage in forced:  # plain `dvc repro` would stop at the new stage, naming the missing file
        print(f"{stage}: a stage new to dvc.yaml has no params file yet: `dvc repro -f -s {stage}` first", flush=True)
        if code := subprocess.run(dvc("repro", "-f", "-s", stage)).returncode:
            return code
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines as they are written, not at exit
    env.pop(JOBS_ENV, None)
    if jobs > 1:
        env[JOBS_ENV] = str(jobs)
    # DVC and the stages' commands in a process group of their own, to which this process passes on
    # every SIGINT (and a SIGTERM, as SIGINT) it gets: a terminal's Ctrl-C and a `kill -INT` of this
    # pid then stop the run alike (before, only the terminal's reached DVC, and a kill of this pid
    # was ignored while DVC started the next stages).
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    proc = subprocess.Popen(dvc(*command, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, **group)
    out, line = sys.stdout.buffer, b""

    def show(data: bytes) -> None:
        """Write through; once the reader has gone (`| head`), stop writing but let DVC finish the
        stage it is in (its own writes go to this pipe, which stays open and drained)."""
        nonlocal out
        if out is None:
            return
        try:
            out.write(data)
            out.flush()
        except BrokenPipeError:
            out = None
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit either

    def forward(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, forward), signal.signal(signal.SIGTERM, forward)
    try:
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            show(chunk)  # bytes as they come: tqdm's carriage returns too
            line += chunk
            *complete, line = line.split(b"\n")
            for text in complete:
                text = text.decode(errors="replace").strip("\r")
                if EXPERIMENT.match(text) and not progress.known:
                    progress.seen.clear()
                    progress.started, progress.start = 0, time.monotonic()
                if end := FINISHED.match(text):
                    progress.end(end["stage"], float(end["seconds"]))
                m = VISIT.match(text)
                if m and (msg := progress.visit(m["run"] or m["skip"], bool(m["run"]))):
                    show(msg.encode() + b"\n")
        code = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    progress.finish()
    write_history(HISTORY, {**history, **progress.seconds})
    ran = progress.ran
    if out is not None:
        print(f"{'done' if code == 0 else 'stopped'}: {ran} stage(s) ran in {hms(time.monotonic() - progress.start)}")
    return code

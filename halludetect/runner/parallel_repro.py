"""`dvc repro` running independent stages side by side: `halludetect repro --jobs N`.

DVC runs a pipeline's stages one after another (its feature request for parallel stages,
iterative/dvc#755, is open since 2018), and its locks make two `dvc repro` processes in one
workspace fail or corrupt each other's bookkeeping. On the demo world that leaves a core idle
whenever a one-process stage runs (evaluate, figures, transfer, analyze, the report) or a train
stage's last layer trains alone on one of two workers: one `make repro` was 1,077 s of stages, and
a schedule of those durations over two slots takes about 800.

This runs DVC's own reproduction with one change: the stages DVC plans (`dvc/repo/reproduce.py`,
in its order) start as soon as every stage they read from has finished, up to N commands at a
time. Everything DVC does around a command (the changed check, the run cache, removing and saving
outputs, committing them to the cache, the lock entry) runs as DVC runs it, under one mutex, so
DVC's state is never touched by two threads at once; only the commands themselves overlap, each
waited on by a thread of its own. So:

- each stage's outputs and its `dvc.lock` entry are the ones a serial run writes (the commands
  are the same, and nothing they compute depends on what runs beside them); the entries keep
  DVC's order: entries new to the lock are placed in plan order (runner/dvc_lock.py), not in the
  order the stages happened to finish;
- a failing stage stops new stages from starting; the stages already running finish and are
  recorded (their work is kept), then the run fails naming the stage, as DVC's does
  (`--keep-going` skips only what depends on it; `--ignore-errors` as in DVC);
- Ctrl-C reaches every running command (one process group), none starts after it, and the ones
  that finished are recorded; a kill at any moment leaves what a serial run leaves (every entry
  is written atomically when its stage ends);
- DVC's repository lock is held for the whole run, where a serial `dvc repro` lets it go while a
  command runs: another DVC command in this workspace is refused ("Unable to acquire lock") until
  the run ends;
- each command's output lines are prefixed with its stage's name (`train@world-world-max | ...`);
  a progress bar's redraws (carriage returns) print as its final line only;
- each command is told its share of the cores (HALLUDETECT_CORES: the usable cores over N), so a
  train stage beside another spawns no more layer workers than its share (on 2 cores with 2 jobs,
  none: its layers train in its own process, with the same bytes);
- the stages take turns on the GPUs: each command is given a lock file (HALLUDETECT_GPU_LOCK, in
  DVC's scratch directory) that a stage process takes before its first use of CUDA
  (core/devices.py `hold_gpu`), so two stages never hold models on the GPUs at once, while the
  stages on the CPU run beside them.

What runs beside a stage can change its *timings* (the throughput, latency and training-time
tables read wall time), never its numbers: run with `--jobs 1`, DVC's own order, for timing tables
that are measured alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

GPU_LOCK_ENV = "HALLUDETECT_GPU_LOCK"  # core/devices.py's (not imported here: it imports torch)
CORES_ENV = "HALLUDETECT_CORES"  # stages/train.py's: the cores a command may count on


class _Run:
    """The state shared by one parallel reproduction's threads."""

    def __init__(self, jobs: int, writer=None):
        self.jobs = jobs
        self.cores = max(1, _usable_cores() // jobs)  # each command's share of the machine
        self.writer = writer  # runner/dvc_lock.py's LockWriter: told the plan, it keeps new entries in its order
        self.mutex = threading.Lock()  # held by a thread whenever it touches DVC
        self.stopping = False  # a stage failed (and the run stops) or SIGINT arrived
        self.interrupted = False
        self.local = threading.local()  # .stage: the stage this worker thread reproduces; .ran: its command ran
        self.zygote = None  # runner/zygote.py: forks the stage commands it can, during a run


_RUN: _Run | None = None


class Stopped(Exception):
    """A stage not started because the run is stopping."""


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def jobs_from(value: str) -> int:
    """`--jobs` (or HALLUDETECT_REPRO_JOBS): a count >= 1, or `auto` (the cores this process may use)."""
    if value == "auto":
        return _usable_cores()
    try:
        jobs = int(value)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ValueError(f"--jobs takes a count of stages at once (1 or more) or 'auto', not {value!r}")
    return jobs


# ---------------------------------------------------------------------------- the schedule
def _announced(repro_fn, run, logger):
    """`repro_fn` saying "Finished stage ... in ... s" for a stage whose command ran, as the parallel
    loop's stages do: with --jobs above 1, `halludetect repro` counts the stages that ran by that
    line (runner/repro.py), DVC's own loop (`-s`, a single item) included."""

    def announce(stage, **kwargs):
        run.local.ran = False
        t0 = time.monotonic()
        ret = repro_fn(stage, **kwargs)
        if ret and run.local.ran:
            logger.info("Finished stage '%s' in %.1f s", stage.addressing, time.monotonic() - t0)
        return ret

    return announce


def _reproduce_parallel(
    stages, graph=None, force_downstream=False, on_error="fail", force=False, repro_fn=None, **kwargs
):
    """dvc.repo.reproduce._reproduce with the planned stages started as their upstream stages end
    (module docstring); the same arguments, results and errors."""
    from halludetect.runner.dvc_internals import reproduce as dvc_reproduce

    repro_fn = repro_fn or dvc_reproduce._reproduce_stage
    serial = graph is None or _RUN is None or _RUN.jobs < 2 or kwargs.get("dry") or kwargs.get("interactive")
    if serial:  # DVC's own loop: a single item (no graph), a dry run, questions asked at each stage
        if _RUN is not None and _RUN.jobs >= 2:  # `halludetect repro` then counts a stage by its end line
            repro_fn = _announced(repro_fn, _RUN, dvc_reproduce.logger)
        return _ORIGINAL(
            stages,
            graph=graph,
            force_downstream=force_downstream,
            on_error=on_error,
            force=force,
            repro_fn=repro_fn,
            **kwargs,
        )
    run = _RUN
    run.stopping = run.interrupted = False  # a process may reproduce more than once (tests, embedding)
    assert on_error in ("fail", "keep-going", "ignore")
    plan = list(stages)
    planned = set(plan)
    upstream = {s: [u for u in graph.successors(s) if u in planned] for s in plan}  # an edge: stage -> what it reads
    if run.writer is not None:  # each lock file's entries by plan order (a plan may span several dvc.yaml)
        run.writer.order = {(lock, s.name): i for i, s in enumerate(plan) if (lock := _lock_path(s))}
    force_state = dict.fromkeys(plan, force)
    result, failed, errors = [], [], []
    to_skip: dict = {}
    done, started = set(), set()
    running: dict[Future, object] = {}

    def task(stage, force_stage):
        with run.mutex:
            if run.stopping:
                raise Stopped
            run.local.stage, run.local.ran = stage, False
            up, _ = dvc_reproduce._get_upstream_downstream_nodes(graph, stage)
            t0 = time.monotonic()
            ret = repro_fn(stage, upstream=up, force=force_stage, **kwargs)
            if ret and run.local.ran:  # its command ran (not a restore from the run cache)
                dvc_reproduce.logger.info("Finished stage '%s' in %.1f s", stage.addressing, time.monotonic() - t0)
            return ret

    run.zygote = _start_zygote(plan)
    previous = signal.signal(signal.SIGINT, _on_sigint)  # the commands get Ctrl-C from the terminal themselves
    try:
        with ThreadPoolExecutor(run.jobs, thread_name_prefix="stage") as pool:
            while True:
                for stage in plan:  # start, in plan order, what is ready
                    if run.stopping or len(running) >= run.jobs:
                        break
                    if stage in started:
                        continue
                    if stage in to_skip:
                        started.add(stage)
                        done.add(stage)
                        continue
                    if all(u in done for u in upstream[stage]):
                        started.add(stage)
                        running[pool.submit(task, stage, force_state[stage])] = stage
                if not running:
                    break
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in finished:
                    stage = running.pop(future)
                    done.add(stage)
                    try:
                        ret = future.result()
                    except Stopped:
                        dvc_reproduce.logger.warning(
                            "Stage '%s' did not run: the run is stopping (its outputs are in the cache; the next run "
                            "makes them again)",
                            stage.addressing,
                        )
                        continue
                    except Exception as exc:  # noqa: BLE001 - as DVC's loop: every stage error is reported
                        failed.append(stage)
                        if on_error == "fail":
                            run.stopping = True
                            errors.append(exc)
                            dvc_reproduce.logger.warning("%s", exc)
                            continue
                        to_skip.update(dict.fromkeys(dvc_reproduce.handle_error(graph, on_error, exc, stage), stage))
                        continue
                    if force_downstream and (ret or force_state[stage]):
                        _, downstream = dvc_reproduce._get_upstream_downstream_nodes(graph, stage)
                        force_state.update(dict.fromkeys(downstream, True))
                    if ret:
                        result.append(ret)
    finally:
        signal.signal(signal.SIGINT, previous)
        if run.zygote is not None:
            run.zygote.close()
            run.zygote = None
    if run.interrupted and (not failed or on_error == "ignore"):
        raise KeyboardInterrupt  # the commands that failed failed of it; in ignore mode it wins
    if errors:
        dvc_reproduce._raise_error(errors[0], *failed)
    if on_error != "ignore" and failed:
        dvc_reproduce._raise_error(None, *failed)
    return result


def _start_zygote(plan):
    """The stage zygote for this run's commands (runner/zygote.py), started in the background, or None."""
    from halludetect.runner.zygote import Zygote

    root = plan[0].repo.root_dir if plan else None
    zygote = Zygote.for_run(dict(os.environ), root) if root else None
    if zygote is not None:
        zygote.start()
    return zygote


def _lock_path(stage) -> str | None:
    """The dvc.lock a pipeline stage's entry is written to (None for a .dvc file's stage)."""
    path = getattr(getattr(stage, "dvcfile", None), "path", None)
    if not path or not str(path).endswith((".yaml", ".yml")):
        return None
    return os.path.abspath(os.path.splitext(path)[0] + ".lock")


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: no stage starts after it; the running commands got it too and stop themselves."""
    if _RUN is not None:
        _RUN.stopping = _RUN.interrupted = True


# ---------------------------------------------------------------------------- around a command
def _unlocked_repo(f):
    """dvc/stage/run.py runs a command with the repository unlocked (another DVC command may run
    meanwhile). Here the lock stays held (the other stages' bookkeeping needs it) and the mutex is
    let go instead, so that the other stages' bookkeeping and commands go on while this one runs."""
    original = _ORIGINAL_UNLOCKED(f)

    def wrapper(stage, *args, **kwargs):
        run = _RUN
        if run is None or getattr(run.local, "stage", None) is None:
            if run is not None:  # DVC's own loop (below): its command runs, as `_announced` needs to know
                run.local.ran = True
            return original(stage, *args, **kwargs)
        if run.stopping:
            raise Stopped
        run.local.ran = True
        stage.repo._reset()  # as DVC before a command: what the command writes is read afresh after it
        run.mutex.release()
        try:
            return f(stage, *args, **kwargs)
        finally:
            run.mutex.acquire()

    return wrapper


def _run_command(executable, cmd, **kwargs):
    """dvc/stage/run.py's `_run` in a worker thread: the command's output (stderr joined) printed
    line by line, each line prefixed with the stage's name. The stage ends when its command exits
    (a process it left in the background may hold the pipe open: its output keeps coming)."""
    run = _RUN
    stage = getattr(run.local, "stage", None) if run is not None else None
    if stage is None:
        return _ORIGINAL_RUN(executable, cmd, **kwargs)
    from halludetect.runner.dvc_internals import StageCmdFailedError, _make_cmd

    kwargs["env"] = command_env(kwargs.get("env") or dict(os.environ), stage.repo.tmp_dir, run.cores)
    proc = _forked(run.zygote, cmd, kwargs) if run.zygote is not None else None
    if proc is None:
        proc = subprocess.Popen(_make_cmd(executable, cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)  # noqa: S603
    pump = threading.Thread(target=_pump, args=(proc.stdout, f"{stage.addressing} | ".encode()), daemon=True)
    pump.start()
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:  # this thread was interrupted: the command goes with it
            proc.kill()
            proc.wait()
    pump.join(timeout=PUMP_GRACE_S)  # what the command wrote before it exited
    if code != 0:
        raise StageCmdFailedError(cmd, code)


def _forked(zygote, cmd: str, kwargs: dict):
    """`cmd` forked by the stage zygote (runner/zygote.py) with its output on a pipe (`.stdout`), or
    None when it runs as DVC runs it: not a plain `python -m stages.<name>`, another environment,
    or the zygote unavailable."""
    from halludetect.runner.dvc_internals import reproduce as dvc_reproduce

    cwd = kwargs.get("cwd") or os.getcwd()
    argv = zygote.accepts(cmd, kwargs["env"], cwd)
    if argv is None:
        return None
    read, write = os.pipe()
    try:
        proc = zygote.spawn(argv, kwargs["env"], cwd, write)
    except OSError as e:
        os.close(read)
        dvc_reproduce.logger.warning("%s; running it as DVC does", e)
        return None
    finally:
        os.close(write)
    proc.stdout = os.fdopen(read, "rb")
    return proc


PUMP_GRACE_S = 5.0  # after a command exits, how long its output may take to reach the end of the pipe
LINE_CAP = 1 << 20  # a "line" longer than this is printed in pieces


def _pump(pipe, prefix: bytes) -> None:
    """Forward a command's output: complete lines prefixed, each chunk's lines in one write; a
    progress bar's redraws (carriage returns) keep their last state only."""
    pending = b""
    try:
        while chunk := pipe.read1(1 << 16):
            head, nl, tail = chunk.rpartition(b"\n")
            if not nl:  # no line ends in this chunk
                pending = _last_redraw(pending + chunk)
                if len(pending) > LINE_CAP:
                    _write(prefix + pending + b"\n")
                    pending = b""
                continue
            lines = (pending + head).split(b"\n")
            _write(b"".join(prefix + _last_redraw(line) + b"\n" for line in lines))
            pending = _last_redraw(tail)
        if pending:
            _write(prefix + pending + b"\n")
    except (OSError, ValueError):  # our stdout closed: the command still runs to its end, unread
        with contextlib.suppress(OSError, ValueError):
            while pipe.read1(1 << 16):
                pass


def _last_redraw(text: bytes) -> bytes:
    """What a terminal would show of text: after its last carriage return (a trailing one aside)."""
    return text.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def _write(data: bytes) -> None:
    """Whole lines to stdout under the lock DVC's own log lines take (tqdm's write lock, which its
    logger writes through), so that neither cuts the other's line."""
    from halludetect.runner.dvc_internals import Tqdm

    with Tqdm.get_lock():
        sys.stdout.flush()
        out = sys.stdout.buffer
        view = memoryview(data)
        while view:  # unbuffered (PYTHONUNBUFFERED): a write may take part of it
            n = out.write(view)
            view = view[n if n is not None else len(view) :]
        out.flush()


def command_env(env: dict, tmp_dir: str, cores: int) -> dict:
    """A command's environment: the GPU lock the stages take turns on (core/devices.py `hold_gpu`)
    in DVC's scratch directory, and its share of the cores (HALLUDETECT_CORES: the usable cores over
    the jobs, so that a train stage beside another spawns no more workers than its share), each
    unless the caller set it (the lock: empty for none)."""
    return {GPU_LOCK_ENV: os.path.join(tmp_dir, "halludetect-gpu.lock"), CORES_ENV: str(cores), **env}


# ---------------------------------------------------------------------------- installing
_ORIGINAL = _ORIGINAL_UNLOCKED = _ORIGINAL_RUN = None


def install(jobs: int, writer=None) -> bool:
    """Make DVC's reproduction run up to `jobs` stages at once in this process (False, with DVC
    unchanged and a warning, when DVC's internals are not the ones this was written against).
    `writer`: the LockWriter (runner/dvc_lock.py) that writes dvc.lock, to keep new entries in plan order."""
    global _RUN, _ORIGINAL, _ORIGINAL_UNLOCKED, _ORIGINAL_RUN
    if jobs < 2:
        return False
    from halludetect.runner import dvc_internals

    try:
        dvc_reproduce, dvc_run = dvc_internals.get("reproduce"), dvc_internals.get("stage_run")
        for name in ("_reproduce", "_get_upstream_downstream_nodes", "handle_error", "_raise_error", "logger"):
            dvc_internals.get(f"reproduce.{name}")
        for name in ("unlocked_repo", "_run"):
            dvc_internals.get(f"stage_run.{name}")
        dvc_internals.get("_make_cmd")
        dvc_internals.get("StageCmdFailedError")
    except dvc_internals.Missing as e:
        import warnings

        warnings.warn(f"stages run one at a time: DVC's reproduction is not the one --jobs knows: {e}", stacklevel=2)
        return False
    _RUN = _Run(jobs, writer)
    _ORIGINAL, _ORIGINAL_UNLOCKED, _ORIGINAL_RUN = dvc_reproduce._reproduce, dvc_run.unlocked_repo, dvc_run._run
    dvc_reproduce._reproduce = _reproduce_parallel
    dvc_run.unlocked_repo = _unlocked_repo
    dvc_run._run = _run_command
    return True

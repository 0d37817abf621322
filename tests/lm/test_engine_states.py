"""The engine's states files as untrusted input (lm/engine_states.py): `StatesDir` opens only a regular
file of its own name in its own directory (no symlink, FIFO, directory, hard link or oversized file),
waits for vLLM's writer lock with a deadline, and sweeps only its own names whose writer is done;
`check_states` refuses what no engine computed for the request (wrong dtype, shape, tokens, values)
and accepts a file that runs past the answer, as a stop string leaves it in vLLM."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from halludetect.lm.engine_states import StatesDir, StatesProblem, check_states, engine_dir

PROMPT, OUTPUT = [5, 6, 7], [8, 9, 10]  # the file holds prompt + output[:-1]: 5 tokens


def states_file(path, tokens=(5, 6, 7, 8, 9), layers=2, hidden=4, dtype=torch.float32, fill=None):
    t = len(tokens)
    x = torch.randn(t, layers, hidden).to(dtype) if fill is None else torch.full((t, layers, hidden), fill, dtype=dtype)
    save_file({"hidden_states": x, "token_ids": torch.tensor(list(tokens), dtype=torch.int64)}, str(path))


@pytest.fixture
def states(tmp_path):
    d = StatesDir(tmp_path / "states")
    yield d
    d.close(wait_s=0)  # names a test handed out and never released: no wait for them


def snapshot(root):
    """Every file under `root` with its bytes: what must stay byte-identical."""
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_a_file_of_ours_is_read_once_its_writer_releases_the_lock(states):
    name = states.new()
    path = states.path / name
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)  # as vLLM's worker, before replying
    fcntl.flock(lock, fcntl.LOCK_EX)

    def write():
        time.sleep(0.05)
        states_file(path)
        os.close(lock)  # releases the flock, as vLLM's writer thread does after save_file

    threading.Thread(target=write).start()
    data = states.read(name, max_bytes=1 << 20)
    assert data["token_ids"].tolist() == [5, 6, 7, 8, 9]
    states.release(name)
    assert not list(states.path.glob("hd-*")), "the file and its lock go once used"


def test_a_writer_that_never_finishes_or_a_file_that_never_appears_is_named_not_waited_for(states):
    name = states.new()
    with pytest.raises(StatesProblem, match="did not appear within 0 s"):
        states.read(name, max_bytes=1 << 20, appear_s=0.05)
    lock = os.open(states.path / f"{name}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with pytest.raises(StatesProblem, match="still being written after 0 s"):
            states.read(name, max_bytes=1 << 20, write_s=0.05)
    finally:
        os.close(lock)


@pytest.mark.hostile
@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "hard_link", "too_large", "lock_symlink"])
def test_what_is_not_a_regular_file_of_ours_is_refused_and_nothing_outside_is_touched(tmp_path, kind):
    victims = tmp_path / "victims"
    victims.mkdir()
    states_file(victims / "model.safetensors")
    (victims / "model.safetensors.lock").write_text("a user's lock")
    before = snapshot(victims)
    with StatesDir(tmp_path / "states") as states:
        name = states.new()
        path = states.path / name
        if kind == "symlink":
            path.symlink_to(victims / "model.safetensors")
        elif kind == "fifo":
            os.mkfifo(path)  # opened without O_NONBLOCK, a FIFO would hang the reader past every deadline
        elif kind == "directory":
            path.mkdir()
        elif kind == "hard_link":
            os.link(victims / "model.safetensors", path)
        elif kind == "too_large":
            states_file(path, tokens=range(500), hidden=64)
        else:
            (states.path / f"{name}.lock").symlink_to(victims / "model.safetensors.lock")
        t0 = time.monotonic()
        with pytest.raises(StatesProblem, match="not a regular file|cannot be opened|more than the request"):
            states.read(name, max_bytes=4096, appear_s=5, write_s=5)
        assert time.monotonic() - t0 < 5, "refused at once, not after a deadline"
        states.release(name)
        assert not [p for p in states.path.iterdir() if p.name.startswith("hd-")]
    assert snapshot(victims) == before
    assert (victims / "model.safetensors").exists() and (victims / "model.safetensors.lock").exists()


def test_the_sweep_removes_our_finished_files_only(states, tmp_path):
    live = states.new()
    states_file(states.path / live)  # in flight: kept
    done = "hd-" + "a" * 24 + ".safetensors"
    states_file(states.path / done)
    (states.path / f"{done}.lock").touch()  # its writer is done: removed with its lock
    busy = "hd-" + "b" * 24 + ".safetensors"
    lock = os.open(states.path / f"{busy}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the engine is still writing it: kept for the next sweep
    foreign = ["cmpl-abc-0-1234abcd.safetensors", "hd-short.safetensors", "notes.txt"]
    for f in foreign:
        (states.path / f).write_text("not ours")
    try:
        assert states.sweep() == 2
        left = sorted(p.name for p in states.path.iterdir())
        assert left == sorted([live, f"{busy}.lock", *foreign, ".halludetect-owner"])
    finally:
        os.close(lock)
    assert states.sweep() == 1  # the lock is free now: the busy one's lock goes
    orphan = "hd-" + "d" * 24 + ".safetensors"
    states_file(states.path / orphan)
    assert states.sweep(limit=0) == 0 and (states.path / orphan).exists()  # bounded: no more names than given
    assert states.sweep() == 1 and not (states.path / orphan).exists()


def test_foreign_entries_never_starve_the_sweep(states):
    """Only our names count to a sweep's bound: a folder crowded with others' files is still swept."""
    for i in range(300):
        (states.path / f"cmpl-{i}-0-abcdef12.safetensors").touch()
    orphans = [f"hd-{i:024x}.safetensors" for i in range(20)]
    for name in orphans:
        (states.path / name).touch()
    assert states.sweep(limit=10) == 10 and states.sweep(limit=10) == 10
    assert not any((states.path / name).exists() for name in orphans)
    assert len(list(states.path.glob("cmpl-*"))) == 300  # not ours: never touched


def test_a_closed_directory_is_never_used_again(tmp_path):
    """A server stopping while requests are in flight: their threads meet a StatesProblem, never a stale
    descriptor (which would list or unlink in whatever directory took its number)."""
    states = StatesDir(tmp_path / "s")
    name = states.new()
    states.close(wait_s=0)
    with pytest.raises(StatesProblem, match="is closed"):
        states.read(name, max_bytes=1 << 20)
    with pytest.raises(StatesProblem, match="is closed"):
        states.sweep()
    states.release(name)  # quietly: nothing to do once closed


def test_an_owner_flock_won_on_a_file_already_unlinked_owns_nothing(tmp_path, monkeypatch):
    """A temporary directory's owner unlinks its owner file as it closes: a process that opened the
    old file before and then wins its flock must not take the directory."""
    import halludetect.lm.engine_states as engine_states

    first = StatesDir(tmp_path / "d", temporary=True)
    real_flock = fcntl.flock

    def flock_after_the_owner_left(fd, op):  # the first owner closes between our open and our flock
        first.close(wait_s=0)
        (tmp_path / "d").mkdir(exist_ok=True)
        return real_flock(fd, op)

    monkeypatch.setattr(engine_states.fcntl, "flock", flock_after_the_owner_left)
    with pytest.raises(StatesProblem, match="in use by another"):
        StatesDir(tmp_path / "d")


def test_a_directory_has_one_owner_at_a_time(tmp_path):
    with StatesDir(tmp_path / "d"), pytest.raises(StatesProblem, match="in use by another halludetect process"):
        StatesDir(tmp_path / "d")
    StatesDir(tmp_path / "d").close()  # free again once the first closes
    with StatesDir(tmp_path / "t", temporary=True) as t:
        states_file(t.path / ("hd-" + "c" * 24 + ".safetensors"))
    assert not (tmp_path / "t").exists(), "a temporary directory goes with its last file"


def test_engine_directories_of_two_runs_or_processes_differ(tmp_path):
    a, b = tmp_path / "gen/world/.world.states", tmp_path / "gen/world/.lookalike.states"
    assert engine_dir(a, None, 0) == a.with_name(".world.states.engine-r0")
    shared = tmp_path / "shm"
    assert len({engine_dir(a, shared, 0), engine_dir(b, shared, 0), engine_dir(a, shared, 1)}) == 3
    assert all(engine_dir(x, shared, 0).parent == shared for x in (a, b))


def load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_states_that_run_past_the_answer_are_cut_to_it(tmp_path):
    """A stop string ends the answer in vLLM's front end; the engine went on a token or two."""
    states_file(tmp_path / "f", tokens=[5, 6, 7, 8, 9, 11, 12])
    rows = check_states(load(tmp_path / "f"), prompt=PROMPT, output=OUTPUT, layers=2, hidden=4)
    assert rows.shape == (5, 2, 4)


@pytest.mark.hostile
@pytest.mark.parametrize(
    "file, match",
    [
        (dict(dtype=torch.int32, fill=0), "not vLLM's float"),
        (dict(fill=0.0), "all zero"),
        (dict(fill=float("nan")), "not finite"),
        (dict(tokens=[5, 6, 7, 8]), "do not begin with the request's prompt and output"),
        (dict(tokens=[5, 6, 7]), "prompt's states only"),
        (dict(tokens=[5, 6, 7, 9, 8]), "another request's file"),
        (dict(layers=3), "3 layer"),
        (dict(hidden=8), "width 8"),
    ],
    ids=["int32_zeros", "float_zeros", "nan", "too_few_tokens", "prompt_only", "other_tokens", "layers", "width"],
)
def test_states_no_engine_computed_for_the_request_are_refused(tmp_path, file, match):
    states_file(tmp_path / "f", **file)
    with pytest.raises(StatesProblem, match=match):
        check_states(load(tmp_path / "f"), prompt=PROMPT, output=OUTPUT, layers=2, hidden=4)


@pytest.mark.hostile
def test_fewer_state_rows_than_token_ids_are_refused(tmp_path):
    save_file({"hidden_states": torch.randn(3, 2, 4), "token_ids": torch.tensor([5, 6, 7, 8, 9])}, str(tmp_path / "f"))
    with pytest.raises(StatesProblem, match="3 states for 5 token ids"):
        check_states(load(tmp_path / "f"), prompt=PROMPT, output=OUTPUT, layers=2, hidden=4)


def test_a_request_given_up_on_is_swept_once_its_writer_is_done_and_close_waits_for_it(tmp_path):
    states = StatesDir(tmp_path / "s", temporary=True)
    name = states.new()
    path = states.path / name
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the engine runs the request on after the client gave up
    states.release(name)
    assert (states.path / f"{name}.lock").exists(), "a held lock stays: the sweep waits for its writer"
    assert states.sweep() == 0 and states.busy == 1

    def finish():
        time.sleep(0.1)
        states_file(path)
        os.close(lock)

    threading.Thread(target=finish).start()
    states.close(wait_s=30)
    assert not (tmp_path / "s").exists(), "closed once the late file was written and swept"

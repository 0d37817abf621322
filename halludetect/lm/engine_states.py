"""The hidden states a vLLM server keeps while it samples: read safely, checked, kept per answer.

vLLM (0.32.0 to 0.34.0, whose code this follows) started with the `extract_hidden_states` speculative
method and the `ExampleHiddenStatesConnector` (docs/models-and-generation.md, "States from the engine")
writes one safetensors file per request (`EHSC` below is vLLM's
`distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py`, lines of 0.34.0):

    hidden_states  [T, k, d]  the states of the server's layer ids in *ascending* order, whatever order
                              they were listed in (`model_executor/models/interfaces.py:1630`,
                              `sorted(set(ids))`); id 0 the embeddings, id i the residual stream after i
                              blocks, id num_hidden_layers the last block's output *before* the final norm
    token_ids      [T]        the prompt and every token the engine generated but the last
                              (`include_output_tokens`, EHSC:540-546)

What that means for a client, and what this module does about it:

- A stop *string* is matched in vLLM's front end, which answers and aborts the request in the engine
  (`v1/engine/output_processor.py:828-885`): that reply names no file (`kv_transfer_params: null`),
  yet the engine still writes one, possibly holding tokens past the answer (it kept decoding until the
  abort arrived). So we never rely on the reply's path: each request names its own file,
  `kv_transfer_params.hidden_states_path`, in a directory we own (`StatesDir`), which vLLM honours
  when started with `allow_custom_save_path` (EHSC:226-234, 506-515). A reply that names another path
  is refused and that path never touched; the file is read by its name in our directory, whatever the
  reply says; its tokens must *begin* with the prompt and the answer (`check_states`).
- vLLM writes a file (and a lock) for every request and deletes none (EHSC:497-560): files of requests
  we gave up on (time-outs, retries) are removed by `StatesDir.sweep`, ours only, without waiting.
- The writer holds an exclusive flock on `<file>.lock` from the request's first step (EHSC:269-290)
  until the file is written, after the reply (EHSC:330-347); a reader takes a shared flock first
  (vLLM's own reader, `load_hidden_states`, EHSC:49-67). With `use_synchronization_lock` off there is
  no lock: the file is read once it parses.
- Everything in the file is untrusted: only a regular file of our own name is opened (no symlink,
  FIFO, device or directory: `O_NOFOLLOW | O_NONBLOCK` and fstat), never more bytes than the request
  can produce, and its dtype, shape, tokens and values are checked before use.

`AnswerStates` is generate's side: it keeps the rows from the prompt's last token on, [len(output), k,
d] (what either position convention of the dump reads: `predicting` rows 0..n-1, `generated` rows
1..n), in a file of its own keyed by the request; when the question's answers are final (empty ones
sampled again), `keep` names each answer's file by its (question, sample). The dump reads them with
`load`. `halludetect serve --engine` reads the same way (scoring/serve.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import math
import os
import re
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path

import torch

from halludetect.core.errors import DataError


class StatesProblem(DataError):
    """A states file that cannot be used: the message says why and what to change."""


def states_dir(generations: str | Path) -> Path:
    """Where generate keeps the engine's states of `generations` (a hidden folder beside it)."""
    g = Path(generations)
    return g.parent / f".{g.stem}.states"


def engine_dir(states: str | Path, base: str | Path | None, rank: int = 0) -> Path:
    """Where the engine writes the files generate's process `rank` asks for, for the answers kept in
    `states` (`states_dir`): beside it, or under `base` (generate.endpoint.states_dir, which runs may
    share: a folder of each run's own there)."""
    s = Path(states).absolute()
    if base is None:
        return s.with_name(f"{s.name}.engine-r{rank}")
    run = hashlib.sha256(str(s).encode()).hexdigest()[:12]
    return Path(base).expanduser().absolute() / f"{s.parent.name}-{s.name.strip('.')}-{run}-r{rank}"


APPEAR_S = 60.0  # how long our file (or its lock) may take to appear: a shared filesystem's delay
WRITE_S = 600.0  # how long its writer may hold the lock
SWEEP_LIMIT = 10_000  # names looked at per sweep: a sweep is bounded, whatever the directory holds
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int64, torch.int32)
OUR_NAME = re.compile(r"hd-[0-9a-f]{24}\.safetensors")
OWNER = ".halludetect-owner"  # the flock that makes one process the directory's owner


class StatesDir:
    """A directory this process owns, where the engine writes the states files we name.

    One owner at a time (an flock on `.halludetect-owner`: a second generate or serve on the same
    directory is refused, since its sweep would remove our files). Names are ours
    (`hd-<24 hex>.safetensors`); everything is opened and removed through the directory's own file
    descriptor, so nothing outside it is ever opened, read or deleted, whatever a reply says.
    Thread-safe: serve's request threads share one."""

    def __init__(self, path: str | Path, *, temporary: bool = False):
        self.path = Path(path).expanduser().absolute()
        self.temporary = temporary
        self._live: set[str] = set()  # names of requests in flight: never swept
        self.busy = 0  # files of ours the last sweep left to their writer (its lock held)
        self._lock = threading.Lock()
        self._closed = True  # until owned
        self.removed = 0  # files (and locks) swept, for the stats
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise StatesProblem(
                f"the engine states directory {self.path} cannot be used ({e.strerror}): give a directory this "
                "process may create and write (and the engine's user too), which the engine sees at the same path"
            ) from None
        try:
            self._owner = self._own()
        except BaseException:
            os.close(self._fd)
            raise
        self._closed = False
        self.sweep()  # what an earlier run left

    def _own(self) -> int:
        """The owner flock, on the owner file that is in the directory now: a closing owner unlinks its
        file before it removes a temporary directory, and a flock won on an unlinked file owns nothing."""
        busy = StatesProblem(
            f"the engine states directory {self.path} is in use by another halludetect process (generate or "
            "serve): give each its own"
        )
        try:
            owner = os.open(OWNER, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self._fd)
        except OSError as e:
            raise StatesProblem(f"{self.path}/{OWNER} cannot be opened ({e.strerror}): remove it") from None
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            here = os.stat(OWNER, dir_fd=self._fd, follow_symlinks=False)
            mine, listed = os.fstat(owner), os.stat(self.path, follow_symlinks=False)
            if (here.st_dev, here.st_ino) != (mine.st_dev, mine.st_ino):
                raise busy
            opened = os.fstat(self._fd)
            if (listed.st_dev, listed.st_ino) != (opened.st_dev, opened.st_ino):
                raise busy  # the directory was removed or replaced since we opened it
        except (BlockingIOError, FileNotFoundError):
            os.close(owner)
            raise busy from None
        except BaseException:
            os.close(owner)
            raise
        return owner

    def _dir(self) -> int:
        """The directory's descriptor; StatesProblem once closed (never a stale number another file took)."""
        with self._lock:
            if self._closed:
                raise StatesProblem(f"the engine states directory {self.path} is closed (the server is stopping)")
            return self._fd

    def new(self) -> str:
        """A fresh name for one request's file, kept from the sweep until `release`d."""
        name = f"hd-{secrets.token_hex(12)}.safetensors"
        with self._lock:
            self._live.add(name)
        return name

    def full(self, name: str) -> str:
        """The path the engine is asked to write `name` at."""
        return str(self.path / name)

    def _open(self, name: str, max_bytes: int | None = None) -> int | None:
        """A descriptor of our regular file `name`, None if it does not exist; StatesProblem for a symlink,
        FIFO, device, directory, hard link or a file larger than `max_bytes`. Looked at before it is
        opened (a device is never opened), opened without following a link and without blocking, and
        then checked to be what was looked at."""
        d = self._dir()
        try:
            seen = os.stat(name, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(seen.st_mode) or seen.st_nlink != 1:  # a symlink, FIFO, device, directory, hard link
            raise StatesProblem(f"{name} is not a regular file of its own (mode {stat.filemode(seen.st_mode)})")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: swapped for a symlink since
            raise StatesProblem(f"{name} cannot be opened as a regular file ({errno.errorcode.get(e.errno)})") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino) or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise StatesProblem(f"{name} changed while it was opened")
        if max_bytes is not None and st.st_size > max_bytes:
            os.close(fd)
            raise StatesProblem(f"{name} holds {st.st_size} bytes, more than the request can produce ({max_bytes})")
        return fd

    def read(self, name: str, *, max_bytes: int, appear_s: float | None = None, write_s: float | None = None):
        """Our file `name`, parsed once its writer released the lock: {"hidden_states", "token_ids", ...}.
        The file or its lock may take `appear_s` (APPEAR_S) to show up, the writer may hold the lock
        `write_s` (WRITE_S): past either, StatesProblem, never a wait without end. The defaults are read
        at the call, so a test can shorten them."""
        from safetensors.torch import load

        appear_s = APPEAR_S if appear_s is None else appear_s
        write_s = WRITE_S if write_s is None else write_s
        appear, written, last, pause = time.monotonic() + appear_s, None, None, 0.0005
        while True:
            pause = min(pause * 1.5, 0.005 if last is None else 0.05)  # a file that did not parse: less often
            lock = self._open(f"{name}.lock")
            try:
                if lock is not None:  # wait for the writer: a shared flock, taken when its exclusive one goes
                    written = written or time.monotonic() + write_s
                    try:
                        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        if time.monotonic() > written:
                            raise StatesProblem(f"{name} was still being written after {write_s:.0f} s") from None
                        time.sleep(pause)
                        continue
                fd = self._open(name, max_bytes)
                if fd is not None:
                    with os.fdopen(fd, "rb") as f:  # read whole: the file is removed once used
                        raw = f.read(os.fstat(fd).st_size)  # checked against max_bytes by _open
                    try:
                        return load(raw)
                    except Exception as e:  # noqa: BLE001  (cut, damaged, or still being written without a lock)
                        last = f"{type(e).__name__}: {e}"
                        if lock is not None:  # complete by the lock's word: damaged
                            raise StatesProblem(f"{name} is not a safetensors file ({last})") from None
            finally:
                if lock is not None:
                    os.close(lock)
            if time.monotonic() > appear:
                if last is not None:
                    raise StatesProblem(f"{name} did not parse within {appear_s:.0f} s ({last})")
                raise StatesProblem(f"{name} did not appear within {appear_s:.0f} s")
            time.sleep(pause)

    def _unlink(self, name: str) -> int:
        d = self._dir()
        for unlink in (os.unlink, os.rmdir):  # a directory in our name's place is removed only if empty
            try:
                unlink(name, dir_fd=d)
                return 1
            except FileNotFoundError:
                return 0
            except OSError:
                continue
        return 0

    def release(self, name: str) -> None:
        """The request is done: its file and lock go (what the engine writes later, the sweep removes)."""
        with self._lock:
            self._live.discard(name)
            if self._closed:  # stopped meanwhile: what is left, the next owner's first sweep removes
                return
        with contextlib.suppress(StatesProblem):  # closed meanwhile
            if self._unlink(name) or not self._held(f"{name}.lock"):
                self._unlink(f"{name}.lock")
        # else: the engine is still at it (a request given up on): its lock stays, so the sweep waits for it

    def _held(self, lock_name: str) -> bool:
        """Whether a writer holds the lock `lock_name` (False when there is none, or it is not a file)."""
        try:
            fd = self._open(lock_name)
        except StatesProblem:
            return False
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def sweep(self, limit: int = SWEEP_LIMIT) -> int:
        """Remove our files of requests no longer in flight whose writer is done (its lock free, or none);
        at most `limit` of our names each time (however many foreign entries the directory holds), never
        a wait. Returns how many files were removed."""
        stems: set[str] = set()
        with os.scandir(self._dir()) as entries:  # every entry is looked at; only ours count to the bound
            for e in entries:
                stem = e.name.removesuffix(".lock")
                if OUR_NAME.fullmatch(stem) and stem not in stems:
                    if len(stems) >= limit:
                        break
                    stems.add(stem)
        with self._lock:  # read after the listing: a name handed out before its file could be listed is kept
            stems -= self._live
        removed = busy = 0
        for stem in sorted(stems):
            if self._held(f"{stem}.lock"):
                busy += 1  # its writer is still at work: the next sweep
                continue
            removed += self._unlink(stem) + self._unlink(f"{stem}.lock")
        with self._lock:
            self.removed += removed
            self.busy = busy
        return removed

    def close(self, wait_s: float = 10.0) -> None:
        """A last sweep, waiting up to `wait_s` for requests still in flight and for the writers of files
        of ours still at work (requests given up on: vLLM writes an aborted request's file once the abort
        reaches its engine); then the ownership goes, and a temporary directory with it if nothing else
        is in it. Every later use raises StatesProblem."""
        if self._closed:
            return
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(OSError, StatesProblem):
            self.sweep()
            while (self.busy or self._live) and time.monotonic() < deadline:
                time.sleep(0.05)
                self.sweep()
        with self._lock:
            self._closed = True
            if self.temporary:
                with contextlib.suppress(OSError):
                    os.unlink(OWNER, dir_fd=self._fd)
            os.close(self._owner)
            os.close(self._fd)
        if self.temporary:
            with contextlib.suppress(OSError):
                self.path.rmdir()

    def __enter__(self) -> StatesDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def max_bytes(self, tokens: int, layers: int, hidden: int) -> int:
        """The most a file of `tokens` states of `layers` x `hidden` can hold (float64, and a header)."""
        return tokens * layers * hidden * 8 + (1 << 20)


def check_states(data: dict, *, prompt: list[int], output: list[int], layers: int, hidden: int) -> torch.Tensor:
    """The rows of an engine's states file that belong to the request, [len(prompt) + len(output) - 1, k,
    d], each checked: float states of `layers` x `hidden`, one per token id, finite and not all zero;
    tokens that begin with the prompt and the output but its last token (the file may run past the
    answer: a stop string ends it in vLLM's front end while the engine goes on a step or two).
    StatesProblem says what is wrong."""
    states, tokens = data.get("hidden_states"), data.get("token_ids")
    if not isinstance(states, torch.Tensor) or not isinstance(tokens, torch.Tensor):
        raise StatesProblem("is not a hidden-states file (hidden_states [T, k, d] and token_ids [T])")
    if states.dtype not in FLOATS or states.dim() != 3 or tokens.dtype not in INTS or tokens.dim() != 1:
        raise StatesProblem(
            f"holds hidden_states {states.dtype} {list(states.shape)} and token_ids {tokens.dtype} "
            f"{list(tokens.shape)}: not vLLM's float [T, k, d] states and integer [T] ids"
        )
    if states.shape[0] != tokens.shape[0]:
        raise StatesProblem(f"holds {states.shape[0]} states for {tokens.shape[0]} token ids")
    if states.shape[1] != layers or states.shape[2] != hidden:
        raise StatesProblem(
            f"holds states of {states.shape[1]} layer(s) of width {states.shape[2]}, not {layers} of {hidden}: "
            "the layer ids given (generate.endpoint.hidden_states, --engine-layers) must be the server's "
            "eagle_aux_hidden_state_layer_ids, and the server must serve the preset's model"
        )
    want = prompt + output[:-1]
    got = tokens[: len(want)].tolist()
    if got != want:
        if tokens.tolist() == prompt and len(want) > len(prompt):
            raise StatesProblem(
                "holds the prompt's states only: the server ignores include_output_tokens (vLLM saves the "
                "output tokens' states from 0.32 on)"
            )
        raise StatesProblem(
            f"holds {tokens.shape[0]} tokens that do not begin with the request's prompt and output "
            f"({len(prompt)} + {len(output)} - 1): another request's file"
        )
    rows = states[: len(want)]
    top = float(rows.abs().amax()) if rows.numel() else 1.0  # NaN if any is NaN: one pass checks all three
    if not math.isfinite(top):
        raise StatesProblem("holds states that are not finite (NaN or inf)")
    if top == 0:
        raise StatesProblem("holds states that are all zero: no model computed them")
    return rows


class AnswerStates:
    """The states of one generate run's answers in `directory`, for the engine's layer ids `layers`
    (any order: the engine's columns, and so ours, are in ascending id order); `engine` is the
    directory the engine writes each request's file in (None: `load` only, for the dump)."""

    def __init__(self, directory: str | Path, layers: list[int] | None = None, engine: StatesDir | None = None):
        self.dir, self.layers, self.engine = Path(directory), sorted(set(layers or [])), engine

    def reset(self) -> None:
        """A fresh run: nothing of an earlier one stays (a resumed run keeps what it has)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _request_path(self, key: str) -> Path:
        return self.dir / f"request_{key}.safetensors"

    def answer_path(self, question_id: str, sample_index: int) -> Path:
        name = hashlib.sha256(str(question_id).encode()).hexdigest()[:24]
        return self.dir / f"{name}_{int(sample_index)}.safetensors"

    def take(
        self, name: str, transfer_params, prompt: list[int], output_ids: list[int], key: str, *, hidden: int,
        max_tokens: int,
    ) -> None:  # fmt: skip
        """Keep the states of one request, read from our file `name` in the engine directory (whatever
        path the reply names: a reply names none when a stop string ended the answer); `transfer_params`
        is the reply's `kv_transfer_params`, `prompt` the ids sent, `output_ids` the output's ids as the
        engine returned them (EOS or the stop-completing token included). The engine's file goes,
        read or not. StatesProblem if unusable."""
        from safetensors.torch import save_file

        try:
            named = transfer_params.get("hidden_states_path") if isinstance(transfer_params, dict) else None
            if named is not None and named != self.engine.full(name):
                raise StatesProblem(
                    "names another states file than the one asked for (kv_transfer_params.hidden_states_path): the "
                    'server ignores the path each request gives; start it with "allow_custom_save_path": true in '
                    'kv_connector_extra_config (docs/models-and-generation.md, "States from the engine")'
                )
            limit = self.engine.max_bytes(len(prompt) + max_tokens, len(self.layers), hidden)
            try:
                data = self.engine.read(name, max_bytes=limit)
            except StatesProblem as e:
                raise StatesProblem(
                    f"gave no usable states file in {self.engine.path}: {e}. The server must write where generate "
                    "reads (the same machine or a shared filesystem, generate.endpoint.states_dir), with "
                    'hidden-state extraction and "allow_custom_save_path": true'
                ) from None
            try:
                rows = check_states(data, prompt=prompt, output=output_ids, layers=len(self.layers), hidden=hidden)
            except StatesProblem as e:
                raise StatesProblem(f"gave a states file that {e}") from None
        finally:
            self.engine.release(name)
        rows = rows[len(prompt) - 1 :].contiguous()  # [len(output), k, d]: from the prompt's last token on
        out = self._request_path(key)
        tmp = out.with_name(out.name + ".tmp")
        save_file(
            {"states": rows, "layers": torch.tensor(self.layers), "token_ids": torch.tensor(output_ids)}, str(tmp)
        )
        os.replace(tmp, out)

    def discard(self, key: str) -> None:
        """The states of a request whose answer was sampled again (empty): not kept."""
        self._request_path(key).unlink(missing_ok=True)

    def keep(self, question_id: str, sample_index: int, key: str) -> None:
        """The request `key`'s states are answer `sample_index` of `question_id`'s."""
        src, dst = self._request_path(key), self.answer_path(question_id, sample_index)
        if src.exists():
            os.replace(src, dst)
        elif not dst.exists():  # neither: kept from nowhere
            raise StatesProblem(
                f"the states of request {key[:12]} (question '{question_id}') are missing from {self.dir}"
            )

    def load(self, question_id: str, sample_index: int) -> tuple[torch.Tensor, list[int], list[int]]:
        """(states [len(output), k, d], the layer ids, the output's ids) of one answer."""
        from safetensors.torch import load_file

        path = self.answer_path(question_id, sample_index)
        if not path.exists():
            raise StatesProblem(
                f"no engine states for answer {sample_index} of question '{question_id}' in {self.dir}: generate "
                "sampled it without generate.endpoint.hidden_states, or the folder was removed (it is not a DVC "
                "output). Re-run generate with it (dvc repro -f generate@<model>-<dataset>), or set dump.source: hf"
            )
        try:
            data = load_file(str(path))
            return data["states"], data["layers"].tolist(), data["token_ids"].tolist()
        except Exception as e:  # noqa: BLE001  (cut, damaged or foreign: named, never used)
            raise StatesProblem(
                f"{path} (the engine states of answer {sample_index} of question '{question_id}') cannot be read "
                f"({type(e).__name__}: {e}): re-run generate (dvc repro -f generate@<model>-<dataset>)"
            ) from None

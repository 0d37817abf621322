"""The hidden states a vLLM server keeps while it samples, kept per answer for `dump.source: engine`.

vLLM started with the `extract_hidden_states` speculative method and the `ExampleHiddenStatesConnector`
(docs/models-and-generation.md, "States from the engine") writes, for each request that asks
`kv_transfer_params: {"include_output_tokens": true}`, one safetensors file whose path comes back in
the response's `kv_transfer_params.hidden_states_path`:

    hidden_states  [T, k, d]  the states of the layer ids the server was started with, in that order
                              (`generate.endpoint.hidden_states`); id 0 the embeddings, id i the
                              residual stream after i blocks, id num_hidden_layers the last block's
                              output *before* the final norm
    token_ids      [T]        the prompt and every output token but the last (no forward pass saw it)

The writer holds an exclusive flock on `<file>.lock` until the file is complete (it writes after the
reply), so a reader takes a shared flock first. The file must be readable where `generate` runs (the
same machine, or a shared filesystem).

`AnswerStates.take` reads one reply's file, checks it (the request's tokens, the number of layers),
keeps the rows from the prompt's last token on, [len(output), k, d] (what either position convention
of the dump reads: `predicting` rows 0..n-1, `generated` rows 1..n), in a file of its own keyed by the
request, and deletes the engine's file. When the question's answers are final (empty ones sampled
again), `keep` names each answer's file by its (question, sample). The dump reads them with `load`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
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


APPEAR_S = 60.0  # how long a named file (or its lock) may take to appear: a shared filesystem's delay
WRITE_S = 600.0  # how long its writer may hold the lock


def read_engine_file(path: str, appear_s: float | None = None, write_s: float | None = None) -> dict[str, torch.Tensor]:
    """vLLM's states file, read whole into memory once its writer has released the lock (if it takes
    one). The lock or the file may take `appear_s` (APPEAR_S) to show up (vLLM answers before it
    writes, and a shared filesystem shows files late); the writer may hold the lock `write_s`
    (WRITE_S): past either, FileNotFoundError or TimeoutError naming the file, never a wait without
    end. The defaults are read at the call, so a test can shorten them."""
    from safetensors.torch import load

    appear_s = APPEAR_S if appear_s is None else appear_s
    write_s = WRITE_S if write_s is None else write_s
    lock, deadline = f"{path}.lock", time.monotonic() + appear_s
    while not os.path.exists(lock) and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise FileNotFoundError(errno.ENOENT, f"no such file after {appear_s:.0f} s", path)
        time.sleep(0.01)
    if os.path.exists(lock):
        with open(lock) as f:
            deadline = time.monotonic() + write_s
            while True:  # the shared lock, taken once the writer's exclusive one is released
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{path} was still being written after {write_s:.0f} s") from None
                    time.sleep(0.01)
            with open(path, "rb") as data:  # read whole: the file is deleted once used, a mapping with it
                return load(data.read())
    with open(path, "rb") as data:  # a server without the lock (use_synchronization_lock off)
        return load(data.read())


def remove_engine_file(path: str) -> None:
    """The server's states file and its lock, once read; only a `.safetensors` file is ever removed."""
    if not str(path).endswith(".safetensors"):
        return
    for p in (path, f"{path}.lock"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


class AnswerStates:
    """The states of one generate run's answers in `directory`, for the engine's layer ids `layers`."""

    def __init__(self, directory: str | Path, layers: list[int] | None = None):
        self.dir, self.layers = Path(directory), list(layers or [])  # layers: what `take` expects

    def reset(self) -> None:
        """A fresh run: nothing of an earlier one stays (a resumed run keeps what it has)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _request_path(self, key: str) -> Path:
        return self.dir / f"request_{key}.safetensors"

    def answer_path(self, question_id: str, sample_index: int) -> Path:
        name = hashlib.sha256(str(question_id).encode()).hexdigest()[:24]
        return self.dir / f"{name}_{int(sample_index)}.safetensors"

    def take(self, transfer_params, prompt: list[int], output_ids: list[int], key: str) -> None:
        """Keep the states of one reply (its engine's `kv_transfer_params`, the prompt sent and the
        output's ids as the engine returned them, EOS or stop token included); StatesProblem if unusable."""
        from safetensors.torch import save_file

        path = transfer_params.get("hidden_states_path") if isinstance(transfer_params, dict) else None
        if not isinstance(path, str) or not path:
            raise StatesProblem(
                "has no kv_transfer_params.hidden_states_path: the server was not started with hidden-state "
                'extraction (vllm serve ... --speculative_config \'{"method": "extract_hidden_states", ...}\' '
                '--kv_transfer_config \'{"kv_connector": "ExampleHiddenStatesConnector", ...}\'), or drop '
                "generate.endpoint.hidden_states"
            )
        try:
            data = read_engine_file(path)
        except FileNotFoundError:
            raise StatesProblem(
                f"names the states file {path}, which is not readable here: generate must see the server's "
                "shared_storage_path (run it on the same machine, or on a shared filesystem)"
            ) from None
        except TimeoutError as e:
            raise StatesProblem(f"names the states file {path}: {e} (the server's writer is stuck?)") from None
        except Exception as e:  # noqa: BLE001  (a cut or damaged file: named, never used)
            raise StatesProblem(f"names the states file {path}, which cannot be read: {e}") from None
        states, tokens = data.get("hidden_states"), data.get("token_ids")
        if states is None or tokens is None or states.dim() != 3:
            raise StatesProblem(f"names {path}, which is not a hidden-states file (hidden_states [T, k, d], token_ids)")
        tokens = tokens.tolist()
        if tokens == prompt and output_ids[:-1]:
            raise StatesProblem(
                f"names {path}, which holds the prompt's states only: the server ignores include_output_tokens "
                "(vLLM saves the output tokens' states from 0.33 on)"
            )
        if tokens != prompt + output_ids[:-1]:
            raise StatesProblem(
                f"names {path}, whose {len(tokens)} tokens are not the request's prompt and output ({len(prompt)} + "
                f"{len(output_ids)} - 1): another request's file"
            )
        if states.shape[0] != len(tokens) or states.shape[1] != len(self.layers):
            raise StatesProblem(
                f"names {path} with states of {states.shape[1]} layer(s) for {states.shape[0]} tokens; "
                f"generate.endpoint.hidden_states lists {len(self.layers)} ({self.layers}): set it to the "
                "server's eagle_aux_hidden_state_layer_ids, in their order"
            )
        rows = states[len(prompt) - 1 :].contiguous()  # [len(output), k, d]: from the prompt's last token on
        out = self._request_path(key)
        tmp = out.with_name(out.name + ".tmp")
        save_file(
            {"states": rows, "layers": torch.tensor(self.layers), "token_ids": torch.tensor(output_ids)}, str(tmp)
        )
        os.replace(tmp, out)
        remove_engine_file(path)

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

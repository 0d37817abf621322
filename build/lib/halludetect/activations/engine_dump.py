"""`dump.source: engine`: the per-layer HDF5 files from the states the serving engine kept while it
sampled (lm/engine_states.py), with no second model: the same files, rows and order as the `hf` dump
(capture.py), equal to its states to float tolerance (tests/activations/test_engine_dump.py; the
sharing DAG of tests/test_e2e_sharing.py runs this way).

What the engine's states are, against the dump's layer numbering (0 = embeddings, i = after block i,
the top one after the final norm, as `output_hidden_states` gives them):

- engine id i < num_hidden_layers is the dump's layer i;
- engine id num_hidden_layers is the last block's output *before* the final norm: the top layer is
  that state through the model's final norm, applied here (`FinalHead`: the norm's and the LM head's
  weights, read from the model's files; nothing else of the model is loaded);
- the engine saved every token but the output's last: a `predicting` bag (rows 0..n-1 from the
  prompt's last token) always exists; a `generated` bag (rows 1..n) lacks its last state for an
  answer that ran to max_new_tokens with no end token after it: refused, naming the answer.

The log-prob check (`dump.logprob_check`) recomputes each answer token's log-prob from the top
state through the local final norm and LM head, the model's own last steps, so a server whose
model is not the preset's still fails the dump (it needs the top id among the server's layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import torch
from tqdm import tqdm

from halludetect.activations.capture import POSITIONS, _decoder_layers
from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_writer import LayerWriter, fsync_files
from halludetect.activations.logprob_check import LogprobCheck
from halludetect.config import ModelPreset
from halludetect.lm.engine_states import AnswerStates, StatesProblem
from halludetect.lm.hf_models import DTYPES, is_local, load_config
from halludetect.qa.responses import response_id


class FinalHead:
    """A model's final norm and (`head`) LM head, loaded alone from its weight files, in the dtype the
    hf dump runs the model in (the preset's; for `auto`, the checkpoint's)."""

    def __init__(self, preset: ModelPreset, head: bool = True):
        from transformers import AutoModelForCausalLM

        config = load_config(preset)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=preset.trust_remote_code)
        blocks = {id(m) for b in _decoder_layers(model) for m in b.modules()}
        names = {id(m): n for n, m in model.named_modules()}
        norms = [
            (n, m)
            for n, m in model.named_modules()
            if id(m) not in blocks and n and "norm" in type(m).__name__.lower() + n.split(".")[-1].lower()
        ]
        if len(norms) != 1:
            raise StatesProblem(
                f"dump.source engine: cannot tell {type(model).__name__}'s final norm ({[n for n, _ in norms]}), "
                "which the top layer's engine state needs: leave the top layer out of dump.layers (and turn the "
                "log-prob check off), or set dump.source: hf"
            )
        (norm_name, self.norm_module), lm_head = norms[0], model.get_output_embeddings()
        text = config.get_text_config()
        tied = bool(getattr(text, "tie_word_embeddings", False))
        modules = [self.norm_module, *([lm_head] if head else [])]
        wanted = {f"{norm_name}.{k}": (self.norm_module, k) for k, _ in self.norm_module.named_parameters()}
        if head:
            wanted |= {f"{names[id(lm_head)]}.{k}": (lm_head, k) for k, _ in lm_head.named_parameters()}
        embed = f"{names[id(model.get_input_embeddings())]}.weight"
        stored = _read_tensors(preset, [*wanted, *([embed] if head and tied else [])])
        if preset.dtype != "auto":
            dtype = DTYPES[preset.dtype]
        else:  # transformers loads an `auto` preset in the checkpoint's dtype
            dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or torch.float32
            dtype = DTYPES.get(dtype, torch.float32) if isinstance(dtype, str) else dtype
        for module in modules:
            module.to_empty(device="cpu")
        with torch.no_grad():
            for name, (module, key) in wanted.items():
                tensor = stored.get(name)
                if tensor is None and module is lm_head and tied:  # a tied head is the embedding matrix
                    tensor = stored.get(embed)
                if tensor is None:
                    raise StatesProblem(f"dump.source engine: {preset.path} has no tensor '{name}' in its weight files")
                getattr(module, key).copy_(tensor)
        self.norm_module = self.norm_module.to(dtype)
        self.head = lm_head.to(dtype) if head else None
        # what some architectures do to the logits after the head (Gemma 2's soft cap, Cohere's scale)
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.scale = getattr(text, "logit_scale", None)
        self.dtype = dtype  # the rest of the model stays on the meta device, and goes with `model`

    @torch.no_grad()
    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """[N, d] pre-norm top states -> the top layer as the dump records it."""
        return self.norm_module(x.to(self.dtype))

    @torch.no_grad()
    def logprobs(self, pre_norm: torch.Tensor, tokens: torch.Tensor, chunk: int = 256) -> np.ndarray:
        """[N] float64: log-softmax of the LM head on the normed states [N, d] at `tokens` [N], `chunk`
        rows at a time (a batch's [N, V] logits of a 128k vocabulary would not fit)."""
        out = np.empty(len(tokens), dtype=np.float64)
        for i in range(0, len(tokens), chunk):
            logits = self.head(self.norm(pre_norm[i : i + chunk])).float()  # [c, V]
            if self.scale is not None:
                logits = logits * self.scale
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            picked = logits.gather(1, tokens[i : i + chunk, None]).squeeze(1)
            out[i : i + chunk] = (picked - torch.logsumexp(logits, -1)).double().numpy()
        return out


def _read_tensors(preset: ModelPreset, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a model's safetensors files (a local directory or the hub's files)."""
    from safetensors import safe_open

    def path_of(filename: str) -> Path | None:
        if is_local(preset):
            p = Path(preset.path).expanduser() / filename
            return p if p.exists() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(preset.path, filename, revision=preset.revision))
        except EntryNotFoundError:
            return None

    index = path_of("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {n: weight_map[n] for n in names if n in weight_map}
    else:
        files = dict.fromkeys(names, "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for filename in sorted(set(files.values())):
        path = path_of(filename)
        if path is None:
            raise StatesProblem(f"dump.source engine: {preset.path} has no {filename} (safetensors weights are read)")
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for n, fn in files.items():
                if fn == filename and n in present:
                    out[n] = f.get_tensor(n)
    return out


def check_engine_layers(layers: list[int], engine_layers: list[int] | None, top: int, checked: bool) -> None:
    """The dump's layers (and, for the log-prob check, the top one) must be among the server's."""
    engine = set(engine_layers or [])
    missing = [k for k in layers if k not in engine]
    if checked and top not in engine:
        missing.append(top)
    if missing:
        raise StatesProblem(
            f"dump.source engine: layer(s) {sorted(set(missing))} are not among the server's "
            f"({engine_layers}, as its states files say): the dump's layers"
            + (f" and the top one ({top}, which the log-prob check reads)" if checked and top in missing else "")
            + " must be extracted; add them to the server's eagle_aux_hidden_state_layer_ids and to "
            "generate.endpoint.hidden_states (then re-run generate), or set dump.layers to those it has"
        )


def dump_engine(
    generations: pl.DataFrame,
    states: AnswerStates,
    out_dir: Path,
    layers: list[int],
    *,
    top: int,
    hidden: int,
    positions: str,
    dtype: str,
    batch_size: int,
    attrs: dict,
    head: FinalHead | None,
    check: LogprobCheck | None = None,
    log=print,
) -> None:
    """One HDF5 file per layer in `out_dir` from the kept engine states, rows in (question_id,
    sample_index) order as the hf dump writes them; `top` is the model's num_hidden_layers."""
    if positions not in POSITIONS:
        raise ValueError(f"unknown positions '{positions}'; choose from {POSITIONS}")
    generations = generations.sort("question_id", "sample_index")
    writers = {
        layer: LayerWriter(out_dir / layer_filename(layer), hidden, dtype, {**attrs, "layer": layer})
        for layer in layers
    }
    torch_dtype = DTYPES[dtype]
    if check is not None:
        check.answers_expected = generations.height
    first = 1 if positions == "generated" else 0
    try:
        for start in tqdm(range(0, generations.height, batch_size), desc="dump[engine]", unit="batch"):
            batch = generations.slice(start, batch_size).to_dicts()
            blocks: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
            tops, lengths, ids = [], [], []
            for r in batch:
                rid = response_id(r["question_id"], r["sample_index"])
                rows, engine_layers, output = states.load(r["question_id"], r["sample_index"])
                n = r["n_tokens"]
                if list(output[:n]) != list(r["token_ids"]):
                    raise StatesProblem(
                        f"{states.dir}: the engine states of answer '{rid}' are of other tokens than the answer's "
                        "(another run's answers): re-run generate (dvc repro -f generate@<model>-<dataset>)"
                    )
                if rows.shape[0] < first + n:
                    raise StatesProblem(
                        f"answer '{rid}' ran to generate.max_new_tokens with no end token after it, so the engine "
                        "never computed its last token's state (a forward pass sees every token but the last), which a "
                        "'generated' bag reads: set dump.positions: predicting, or dump.source: hf"
                    )
                where = {k: i for i, k in enumerate(engine_layers)}
                if lacking := [k for k in [*layers, *([top] if check else [])] if k not in where]:
                    raise StatesProblem(
                        f"answer '{rid}': its engine states lack layer(s) {lacking} (they have {engine_layers})"
                    )
                for layer in layers:
                    x = rows[first : first + n, where[layer]]  # [n, d]
                    blocks[layer].append(head.norm(x) if layer == top else x)
                if check is not None:
                    tops.append(rows[:n, where[top]])  # the states that predict each answer token
                lengths.append(n)
                ids.append(rid)
            lengths_np = np.asarray(lengths)
            if check is not None:
                tokens = torch.tensor([t for r in batch for t in r["token_ids"]])
                recorded = np.asarray([x for r in batch for x in r["token_logprobs"]], dtype=np.float64)
                check.add(recorded, head.logprobs(torch.cat(tops), tokens), lengths_np, ids)
            for layer, writer in writers.items():
                writer.append(torch.cat(blocks[layer]).to(torch_dtype).numpy(), lengths_np, ids)
    finally:
        for writer in writers.values():
            writer.close(fsync=False)
    fsync_files([w.path for w in writers.values()])
    if check is not None:
        log(check.finish())
    log(f"dumped {generations.height} responses x {len(layers)} layers from the engine's states in {states.dir}")

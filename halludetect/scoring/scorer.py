"""Scoring new answers with a detector bundle: `score_answers` (rows in memory) and `score_file`
(a file, streamed and resumable), behind the `halludetect score` command.

    from halludetect.scoring.scorer import score_answers
    df = score_answers("data/bundles/world/world/max.safetensors",
                       [{"id": "a1", "question": "Where was Sergi Poboum born?",
                         "answer": "Sergi Poboum was born in Calomar."}])

Order of work, so that bad input fails before anything expensive:
 1. the bundle is read, and the base model it names is checked against the model given (same
    hub id and commit, or the same files of a local model; same position convention), from
    the config and files alone;
 2. (files) every input row is checked in a first streamed pass;
 3. the model is loaded: the whole causal LM when its logits are needed (sampling, with
    `generate`; the answers' own token log-probs, which the distribution check compares with the
    bundle's `answer_range`); otherwise, with early exit (`early_exit.load_until`), blocks 1..layer only;
 4. rows go through in batches: prompt + answer ids -> the layer's states -> bags exactly as
    the dump and evaluate build them (stored dtype, then float32) -> each seed's logit ->
    their mean (`score`), Platt probability, flag at the threshold; with `explain`, each
    token's contribution to that mean (detectors/evidence.py) and its text and place in the
    answer (lm/token_text.py); and the answer's token log-probs (their mean and lowest), which
    mark it in or out of the distribution of the answers the detector was fit on
    (scoring/answer_range.py: `in_distribution`, `ood_reason`).

Rows that cannot be scored keep their place with a `reason`: empty_answer, too_long (prompt +
answer longer than the model's context: the row is named in the log), too_short (fewer tokens
than the method reads: a one-token answer has no second-last token for sep_slt; named in the
log), no_p_sem (a method that reads P_sem, given none). A score that comes out NaN or infinite
is never written: the run stops naming the row (`NonFiniteScore`). A bundle without an
`answer_range` (exported before it was recorded), `check_distribution=False`
(--no-distribution-check) or a loaded model without an LM head leave `in_distribution` null, and
the log and the summary say why; nothing pretends the rows were checked.

Options are checked before any weights are read: batch_size and rows_per_part of at
least 1, a device this machine has, a finite threshold, sampling params that validate, a revision
only with a hub model (or the commit a local directory says it holds); and `score_file`'s output
path (a file in an existing folder, and not the input or the bundle). `score_file` owns its parts
directory for the run (core/unit_store.py): a second run on the same output stops at once, naming
the first.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import polars as pl
import torch
from tqdm import tqdm

from halludetect.activations.bags import Bags
from halludetect.activations.capture import bag_positions, bag_slice, capture
from halludetect.activations.logprob_check import teacher_forced_logprobs
from halludetect.config import GenerateParams, ModelPreset
from halludetect.core.atomic_io import file_sha256
from halludetect.core.code_deps import code_digest
from halludetect.core.errors import DataError, UserError
from halludetect.core.unit_store import UnitStore
from halludetect.lm.hf_models import (
    DTYPES,
    context_length,
    eos_ids,
    input_device,
    is_local,
    load_config,
    load_model,
    load_tokenizer,
    n_layers,
    resolve_device,
)
from halludetect.lm.model_inputs import encode_prompt, pad_ids
from halludetect.lm.token_text import char_spans, token_pieces
from halludetect.methods import method as lookup_method
from halludetect.scoring.answer_files import (
    AnswerFile,
    AnswerRow,
    RowCheck,
    check_output,
    output_format,
    output_schema,
    parse_row,
    write_output,
)
from halludetect.scoring.answer_range import CAN_SCORE, RULE, answer_stats, check
from halludetect.scoring.bundle import RANGE_RULE, SCORE_CAN_SCORE, Bundle, ScoreBundle, load_bundle, p_sem_requirement

# The code a finished part depends on: an edit to any of it discards parts kept from an earlier run.
MAX_NAMED = 20  # rows named one by one in the log per reason; the output's reason column has them all


class ModelMismatch(UserError, ValueError):
    """The model given is not the one the bundle's detector was trained on."""


class OptionError(UserError, ValueError):
    """A scoring option that cannot work (a batch size of 0, sampling params out of range, ...)."""


class NonFiniteScore(DataError):
    """A row whose score came out NaN or infinite: the run stops rather than write it."""


def at_least_one(name: str, value) -> int:
    """`value` for an option that counts things (`name`: how the CLI and the API spell it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a whole number of at least 1, got {value!r}")
    return value


def checked_generate(generate: GenerateParams | None) -> GenerateParams | None:
    """Sampling params validated again: `model_copy(update=...)` (or a hand-built object) skips
    pydantic's checks, and a max_new_tokens of 0 would sample nothing."""
    if generate is None:
        return None
    from pydantic import ValidationError

    try:
        return GenerateParams.model_validate(generate.model_dump())
    except ValidationError as e:
        problems = "; ".join(
            f"generate.{'.'.join(map(str, err['loc']))}: {err['msg'].lower()} (got {err['input']!r})"
            for err in e.errors()
        )
        raise OptionError(f"{problems} (--max-new-tokens, --seed and --params set them)") from None


# ------------------------------------------------------------------ which model, and is it the right one
def model_preset(
    bundle: Bundle,
    model: str | ModelPreset | None = None,
    *,
    revision: str | None = None,
    dtype: str | None = None,
    device_map: str | None = None,
) -> ModelPreset:
    """The preset to load: the bundle's own, or its loading options with another path (a local
    copy, say), revision, dtype or placement."""
    if isinstance(model, ModelPreset):
        if revision is not None or dtype is not None or device_map is not None:
            raise OptionError("with a ModelPreset, set its revision, dtype and device_map in the preset itself")
        return model
    base = dict(bundle.meta["base_model"]["preset"])
    if model is not None and model != base["path"]:
        base["path"], base["revision"] = str(model), None
    if revision is not None:
        check_local_revision(ModelPreset.model_validate(base), revision)
        base["revision"] = revision
    if dtype is not None:
        base["dtype"] = dtype
    if device_map is not None:
        base["device_map"] = device_map
    return ModelPreset.model_validate(base)


def local_commit(path: Path) -> str | None:
    """The hub commit a local directory holds, where it says: `huggingface-cli download --local-dir`
    records it per file, and a Hugging Face cache snapshot is named after it."""
    records = sorted((path / ".cache" / "huggingface" / "download").glob("*.metadata"))
    commits = {r.read_text().splitlines()[0].strip() for r in records if r.read_text().strip()}
    if len(commits) == 1:
        return commits.pop()
    if path.parent.name == "snapshots":
        return path.name
    return None


def check_local_revision(preset: ModelPreset, revision: str) -> None:
    """A revision names a hub commit; a local directory holds files. Accept it with a local model
    only when it is the commit the directory says it holds; never ignore it."""
    if not is_local(preset):
        return
    path = Path(preset.path).expanduser()
    held = local_commit(path) if path.is_dir() else None
    if held is None:
        raise ModelMismatch(
            f"--revision {revision} was given with the local model directory {path}, which does not say "
            "which commit it holds: drop --revision (the directory's files are checked against the "
            "bundle's), or pass the hub id"
        )
    if held != revision:
        raise ModelMismatch(
            f"--revision {revision} was given, but the local model directory {path} holds commit {held}: "
            "drop --revision, or pass a directory of that commit"
        )


def model_identity(preset: ModelPreset) -> dict:
    """What pins the model a preset loads, without loading weights: the sha256 of every file of a
    local directory (and the hub commit it holds, if it says), or a hub id's resolved commit."""
    from halludetect.lm.model_manifest import dir_fingerprint, resolve_hub_revision

    if is_local(preset):
        path = Path(preset.path).expanduser()
        if not path.is_dir():
            raise ModelMismatch(
                f"model directory {path} does not exist (a bundle names a local model as the DAG "
                "did, relative to the repository: run from there, or pass --model DIR)"
            )
        return {"path": str(path), "local": True, "files": dir_fingerprint(path), "commit": local_commit(path)}
    return {"path": preset.path, "local": False, "files": None, "commit": resolve_hub_revision(preset)}


def loaded_identity(model) -> dict:
    """The same for a model already loaded: from where it was loaded (`name_or_path`), and the
    commit transformers records for a hub download."""
    from halludetect.lm.model_manifest import dir_fingerprint

    src = str(getattr(model.config, "name_or_path", "") or "")
    path = Path(src).expanduser()
    if src and path.is_dir():
        return {"path": src, "local": True, "files": dir_fingerprint(path), "commit": local_commit(path)}
    return {
        "path": src or "(unknown)",
        "local": False,
        "files": None,
        "commit": getattr(model.config, "_commit_hash", None),
    }


def describe_trained(base: dict) -> str:
    if base.get("files"):
        digest = hashlib.sha256(json.dumps(base["files"], sort_keys=True).encode()).hexdigest()
        return f"the local model {base['path']} (files sha256 {digest[:12]})"
    return f"{base['path']} at revision {base.get('revision') or 'main'} (commit {base.get('resolved_revision')})"


def check_model(bundle: Bundle, model: ModelPreset | object, positions: str | None = None) -> dict:
    """Refuse a model other than the bundle's, or another position convention, naming both;
    cheap checks first (no file is hashed, no hub asked, for a plain mismatch). Returns what
    pins the model given (`model_identity`), for the resume fingerprint."""
    base, where = bundle.meta["base_model"], bundle.path or "the bundle"
    trained = describe_trained(base)
    if positions is not None and positions != bundle.positions:
        raise ModelMismatch(
            f"{where} was trained on '{bundle.positions}' token positions; '{positions}' was asked "
            "for. A detector only reads the states it was trained on: drop the option, or export "
            "a bundle from a dump with that convention"
        )
    if isinstance(model, ModelPreset) and not is_local(model):
        if base.get("files"):
            raise ModelMismatch(
                f"{where} was trained on {trained}; the model given is the hub model "
                f"{model.path}: pass the local directory it was trained on (--model DIR)"
            )
        if model.path != base["path"]:
            raise ModelMismatch(f"{where} was trained on {trained}; the model given is {model.path}")
    identity = model_identity(model) if isinstance(model, ModelPreset) else loaded_identity(model)
    if base.get("files"):
        if not identity["local"]:
            raise ModelMismatch(
                f"{where} was trained on {trained}; the model given was loaded from "
                f"{identity['path']}, not from that directory"
            )
        ours, theirs = identity["files"], base["files"]
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            raise ModelMismatch(
                f"{where} was trained on {trained}; the model given, {identity['path']}, has other "
                f"files: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''} differ"
            )
        return identity
    if identity["commit"] is None:
        raise ModelMismatch(
            f"{where} was trained on {trained}; the model given, {identity['path']}, does not say "
            "which commit it holds. Download it with `huggingface-cli download "
            f"{base['path']} --revision {base.get('resolved_revision')} --local-dir DIR` (which "
            "records the commit), or pass the hub id with the Hugging Face cache filled"
        )
    if identity["commit"] != base.get("resolved_revision"):
        raise ModelMismatch(
            f"{where} was trained on {trained}; the model given, {identity['path']}, is commit "
            f"{identity['commit']}: pass --revision {base.get('resolved_revision')}"
        )
    return identity


def check_config(bundle: Bundle, config) -> None:
    cfg = config.get_text_config()
    base = bundle.meta["base_model"]
    got = (n_layers(config), int(cfg.hidden_size))
    want = (int(base["num_hidden_layers"]), int(base["hidden_size"]))
    if got != want:
        raise ModelMismatch(
            f"{bundle.path or 'the bundle'} was trained on {describe_trained(base)} with {want[0]} "
            f"layers of width {want[1]}; the model given has {got[0]} of width {got[1]}"
        )


# ------------------------------------------------------------------------------ the scorer
class Scorer:
    """A bundle and its base model, checked against each other, scoring batches of rows.

    `model`: None (the model the bundle names), a path or hub id (a local copy, say), a
    `ModelPreset`, or a model already loaded (then pass its `tokenizer`). Weights are loaded
    on first use, after every check (`load()`); without `generate` only blocks 1..layer are.
    """

    def __init__(
        self,
        bundle: Bundle | str | Path,
        model=None,
        *,
        tokenizer=None,
        revision: str | None = None,
        dtype: str | None = None,
        device: str = "auto",
        device_map: str | None = None,
        positions: str | None = None,
        generate: GenerateParams | None = None,
        greedy: bool = False,
        threshold: str | float | None = None,
        batch_size: int = 32,
        per_seed: bool = False,
        explain: bool = False,
        check_distribution: bool = True,
        log=print,
    ):
        batch_size = at_least_one("batch_size (--batch-size)", batch_size)
        generate = checked_generate(generate)
        self.device = device if device_map else resolve_device(device, "--device")
        self.bundle = bundle if isinstance(bundle, Bundle | ScoreBundle) else load_bundle(bundle)
        b = self.bundle
        if isinstance(b, ScoreBundle):  # ScoreBundleScorer scores it
            raise UserError(
                f"{b.path} is a score bundle ('{b.method}'): score it with make_scorer, score_answers or score_file"
            )
        inputs = b.meta["inputs"]
        for warning in b.warnings:
            log(f"warning: {warning}")
        if b.reads.question:
            raise UserError(
                f"{b.path} holds a '{b.method}' detector, which scores the K answers of a question together "
                "(EigenScore); halludetect score scores answers one at a time: evaluate it in the DAG"
            )
        # --explain: a bundle without token evidence is refused here, before any file or weight is read
        self.explain, self.evidence_rule = explain, b.evidence_rule() if explain else None
        if generate is not None and b.reads.p_sem:
            raise UserError(
                f"{b.path} holds a '{b.method}' detector, which reads each answer's P_sem (K samples "
                "and their clustering); --generate samples one answer: score answers with a p_sem "
                "column instead"
            )
        self.generate, self.greedy, self.batch_size, self.per_seed, self.log = (
            generate,
            greedy,
            batch_size,
            per_seed,
            log,
        )
        self.threshold_name, self.threshold = b.threshold(threshold)
        # the DAG leaves shorter bags out (detectors/data.py, `too_short`): the token it reads is not there
        self.min_tokens = lookup_method(b.method).reads.min_tokens
        self.states_dtype = DTYPES[inputs["states_dtype"]]
        self.needs_p_sem = b.reads.p_sem
        self._named: Counter = Counter()
        self._loaded = False
        self._setup_model(model, tokenizer, revision, dtype, device_map, positions, "states")
        self.answer_range, self.range_note = self._range(check_distribution)
        self.range_rule, self.can_score = RULE, CAN_SCORE
        self.out_of_range_means = (
            "their answers are not ones the base model would have written, so their scores say little about "
            "whether they are true"
        )
        if self.range_note:
            log(f"note: {self.range_note}")

    def _setup_model(self, model, tokenizer, revision, dtype, device_map, positions, what: str) -> None:
        """The base model checked against the bundle's (a loaded one, or a preset: from its config and
        files, loading nothing); sets preset, model, tokenizer, identity, vocab_size and context.
        `what` the bundle read of the model, for the note on another dtype (states, log-probs)."""
        b, log = self.bundle, self.log
        if model is not None and not isinstance(model, str | Path | ModelPreset):  # a loaded model
            if tokenizer is None:
                raise UserError("a loaded model comes with its tokenizer: pass tokenizer=")
            self.preset, self.model, self.tokenizer = None, model, tokenizer
            self.identity = check_model(b, model, positions)
            config = model.config
        else:
            self.preset = model_preset(b, model, revision=revision, dtype=dtype, device_map=device_map)
            trained_dtype = b.meta["base_model"]["preset"].get("dtype")
            if self.preset.dtype != trained_dtype:
                log(
                    f"the bundle was fitted on {what} of the model in {trained_dtype}; running it in "
                    f"{self.preset.dtype} gives slightly different {what} (and scores)"
                )
            self.model, self.tokenizer = None, tokenizer
            self.identity = check_model(b, self.preset, positions)  # hashes a local model's files; loads nothing
            config = load_config(self.preset)
            check_config(b, config)
        self.vocab_size = int(config.get_text_config().vocab_size)
        self.context = context_length(config)

    def _range(self, check_distribution: bool) -> tuple[dict | None, str | None]:
        """The bundle's range of fit answers' log-probs, or None and why no row will be checked."""
        b = self.bundle
        if not check_distribution:
            return None, "in_distribution is not checked (--no-distribution-check): every row's is null"
        if b.meta.get("answer_range") is None:
            return None, (
                f"{b.path or 'the bundle'} predates the distribution check: it records no range of the "
                "token log-probs of the answers its detector was fit on, so every row's in_distribution "
                "is null (not checked). Re-export it (dvc repro evaluate@<model>-<dataset>-<method>) to add it"
            )
        if self.model is not None and getattr(self.model, "get_output_embeddings", lambda: None)() is None:
            return None, (
                "the model given has no LM head, so the answers' token log-probs cannot be computed: every "
                "row's in_distribution is null (not checked); pass the causal LM"
            )
        return b.meta["answer_range"], None

    # ------------------------------------------------------------------ loading
    def load(self) -> Scorer:
        """The weights (and tokenizer), once; a model given loaded is only moved beside the detector."""
        if self._loaded and self.model is not None:
            return self
        if self.model is None:
            from halludetect.activations.early_exit import load_until

            if self.generate is not None or self.answer_range is not None:  # the logits are needed
                self.model = load_model(self.preset, self.device)
            else:
                self.model = load_until(self.preset, self.bundle.layer, self.device)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.preset)
        self.bundle.to(input_device(self.model))
        self._prompts: dict[str, list[int]] = {}
        self._loaded = True
        return self

    def load_without_model(self) -> Scorer:
        """The tokenizer only, the detector on the CPU: for states that come from elsewhere (a serving
        engine's files, `halludetect serve --engine`), scored with `score_states`."""
        if self.preset is None:
            raise OptionError("load_without_model needs the model's preset (a path or hub id), not a loaded model")
        self.tokenizer = self.tokenizer or load_tokenizer(self.preset)
        self.bundle.to("cpu")
        self._prompts, self._loaded = {}, True
        return self

    def score_states(
        self,
        rows: list[AnswerRow],
        bags: list[torch.Tensor | None],
        answer_ids: list[list[int]],
        logprobs: list[list[float]],
        explain: bool = False,
    ) -> list[dict]:
        """Rows whose answers' bags were computed elsewhere ([n, d] each, in the layer's convention;
        None: not scored, with the row's reason set by the caller): score, flag, range, evidence."""
        out = [self._blank(r, explain) for r in rows]
        done = [i for i, b in enumerate(bags) if b is not None]
        for i, ids in enumerate(answer_ids):
            out[i]["n_tokens"] = len(ids)
        if done:
            dtype = self.states_dtype
            tokens = torch.cat([bags[i].to(dtype).float() for i in done])  # the dump's stored dtype, read as float32
            lps = [logprobs[i] for i in done] if self.answer_range is not None else None
            self._finish(
                done, tokens, [len(bags[i]) for i in done], rows, out, [answer_ids[i] for i in done], lps, explain
            )
        return out

    def _prompt(self, question: str) -> list[int]:
        ids = self._prompts.get(question)
        if ids is None:
            inputs = self.bundle.meta["inputs"]
            ids = encode_prompt(self.tokenizer, question, inputs["chat_template"], inputs["prompt_template"])
            if len(self._prompts) > 4096:  # answers come in runs per question; keep the cache small
                self._prompts.clear()
            self._prompts[question] = ids
        return ids

    def _answer_ids(self, r: AnswerRow) -> list[int]:
        """The answer's tokens: as given, or its text tokenized as the model writes it after the
        prompt (prompt 1 ends with "Answer:", and answers start with a space; a chat template's
        answer starts the assistant turn)."""
        if r.token_ids is not None:  # within the vocabulary: checked with the rows (RowCheck)
            return list(r.token_ids)
        text = r.answer.strip()
        if not text:
            return []
        if not self.bundle.meta["inputs"]["chat_template"]:
            text = " " + text
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _skip(self, out: dict, r: AnswerRow, reason: str, detail: str = "") -> None:
        out["reason"] = reason
        self._named[reason] += 1
        if detail and self._named[reason] <= MAX_NAMED:
            self.log(f"{r.where}{'' if r.id is None else f' (id {r.id!r})'}: {detail}; not scored")
        elif detail and self._named[reason] == MAX_NAMED + 1:
            self.log(f"more rows with reason '{reason}': see the reason column")

    def _too_short(self, n: int) -> str:
        return (
            f"{n} answer token(s); '{self.bundle.method}' reads answers of at least {self.min_tokens} "
            "(the token it reads is not there)"
        )

    # ------------------------------------------------------------------ scoring
    def score(self, rows: list[AnswerRow]) -> list[dict]:
        """One result per row, in order (columns: answer_files.output_schema)."""
        self.load()
        out = [self._blank(r, self.explain) for r in rows]
        if self.generate is not None:
            p = self.generate
            keys = [(p.seed, str(r.row if r.id is None else r.id), 0, 0) for r in rows]
            self._score_sampled(rows, out, keys, p, self.greedy, self.explain)
        else:
            todo = self._to_score(rows, out)
            for a in range(0, len(todo), self.batch_size):
                self._score_forced(todo[a : a + self.batch_size], rows, out)
        if not self.per_seed:
            for o in out:
                del o["seed_scores"]
        return out

    def _to_score(self, rows: list[AnswerRow], out: list[dict]) -> list[tuple[int, list[int], list[int]]]:
        """(index, prompt ids, answer ids) of the rows that can be scored; the others get their reason."""
        todo = []
        for i, r in enumerate(rows):
            prompt, answer = self._prompt(r.question), self._answer_ids(r)
            out[i]["n_tokens"] = len(answer)
            total = len(prompt) + len(answer)
            if not answer:
                self._skip(out[i], r, "empty_answer")
            elif len(answer) < self.min_tokens:
                self._skip(out[i], r, "too_short", self._too_short(len(answer)))
            elif self.context is not None and total > self.context:
                self._skip(
                    out[i],
                    r,
                    "too_long",
                    f"{total} tokens (prompt + answer) do not fit the model's context of {self.context}",
                )
            elif self.needs_p_sem and r.p_sem is None:
                self._skip(out[i], r, "no_p_sem", f"'{self.bundle.method}' reads P_sem and the row has none")
            else:
                todo.append((i, prompt, answer))
        return todo

    @staticmethod
    def _blank(r: AnswerRow, explain: bool) -> dict:
        return {
            "row": r.row,
            "id": r.id,
            "n_tokens": 0,
            "score": None,
            "probability": None,
            "flag": None,
            "reason": None,
            "in_distribution": None,
            "ood_reason": None,
            "mean_logprob": None,
            "min_logprob": None,
            "seed_scores": None,
            **({"question": r.question, "answer": r.answer} if explain else {}),
        }

    def sample_and_score(
        self,
        rows: list[AnswerRow],
        keys: list[tuple],
        params: GenerateParams,
        greedy: bool,
        explain: bool = False,
        stream=None,
        prompts: list[list[int]] | None = None,
    ) -> list[dict]:
        """One sampled answer per row (its question), scored from the sampling pass's own states:
        what `halludetect serve` runs for a batch of requests. `keys` are the rows' random-stream
        keys (seed, id, sample index, attempt), `params` the batch's sampling settings (checked by
        the caller), `explain` adds each token's contribution (the bundle must have evidence),
        `stream` follows the rows' tokens as they are sampled (activations/sampled_states.py),
        `prompts` the rows' prompt ids where the caller has them (else each question is encoded)."""
        self.load()
        out = [self._blank(r, explain) for r in rows]
        self._score_sampled(rows, out, keys, params, greedy, explain, stream, prompts)
        return out

    def _score_forced(self, batch: list[tuple], rows: list[AnswerRow], out: list[dict]) -> None:
        """One teacher-forced pass, exactly as the dump builds its batches: up to the bundle's layer,
        or (to check the distribution) the whole model, as the dump runs it, for the logits too."""
        from halludetect.activations.early_exit import states_until

        b, device = self.bundle, input_device(self.model)
        starts = [bag_slice(len(p), len(a), b.positions).start for _, p, a in batch]
        lengths = [len(a) for _, _, a in batch]
        ids, mask = self._forced_inputs(batch)  # [B, W]
        logprobs = None
        if self.answer_range is None:
            h = states_until(self.model, b.layer, b.n_layers, ids, mask)  # [B, W, d]
        else:
            with torch.no_grad(), capture(self.model, [b.layer]) as store:
                logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, W, V]
            h = store[b.layer]  # [B, W, d]
            logprobs = self._answer_logprobs(batch, logits)
            del logits
        row, col = (t.to(device) for t in bag_positions(starts, lengths))
        # The dump stores the states in the bundle's dtype; evaluate reads them back as float32.
        tokens = h[row, col].to(self.states_dtype).float()  # [N, d]
        self._finish([i for i, _, _ in batch], tokens, lengths, rows, out, [a for _, _, a in batch], logprobs)

    def _forced_inputs(self, batch: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, mask [B, W] of (index, prompt ids, answer ids) rows, prompt + answer right-padded
        as the dump pads them, on the model's input device."""
        ids, mask = pad_ids([p + a for _, p, a in batch], self.tokenizer.pad_token_id, left=False)  # [B, W]
        device = input_device(self.model)
        return ids.to(device), mask.to(device)

    def _answer_logprobs(self, batch: list[tuple], logits: torch.Tensor) -> list[list[float]]:
        """Each answer token's log-prob under the logits [B, W, V] of `_forced_inputs(batch)`, from the
        position that predicts it (the dump's check's, and the generations' token_logprobs)."""
        device = logits.device
        lengths = [len(a) for _, _, a in batch]
        p_row, p_col = (t.to(device) for t in bag_positions([len(p) - 1 for _, p, _ in batch], lengths))
        answer = torch.tensor([t for _, _, a in batch for t in a], device=device)  # [N]
        return [x.tolist() for x in teacher_forced_logprobs(logits, p_row, p_col, answer).split(lengths)]

    def _score_sampled(
        self,
        rows: list[AnswerRow],
        out: list[dict],
        keys: list[tuple],
        p: GenerateParams,
        greedy: bool,
        explain: bool,
        stream=None,
        prompts: list[list[int]] | None = None,
    ) -> None:
        """Sample one answer per question; its bag comes from the sampling pass itself."""
        from halludetect.activations.sampled_states import sample_with_states

        b = self.bundle
        eos = eos_ids(self.model, self.tokenizer)
        todo = []
        for i, r in enumerate(rows):
            out[i] |= {"answer": None, "answer_token_ids": None, "finish_reason": None}
            prompt = self._prompt(r.question) if prompts is None else prompts[i]
            if self.context is not None and len(prompt) + p.max_new_tokens > self.context:
                self._skip(
                    out[i],
                    r,
                    "too_long",
                    f"{len(prompt)} prompt tokens + max_new_tokens {p.max_new_tokens} "
                    f"do not fit the model's context of {self.context}",
                )
            else:
                todo.append((i, prompt))
        for a in range(0, len(todo), self.batch_size):
            batch = todo[a : a + self.batch_size]
            sampled = sample_with_states(
                self.model,
                self.tokenizer,
                [pr for _, pr in batch],
                [keys[i] for i, _ in batch],
                p,
                eos,
                layer=b.layer,
                positions=b.positions,
                states_dtype=self.states_dtype,
                greedy=greedy,
                stream=None if stream is None else stream.rows([i for i, _ in batch]),
            )
            done, bags, ids, logprobs = [], [], [], []
            for (i, _), s in zip(batch, sampled):
                out[i] |= {
                    "answer": s.answer.text,
                    "answer_token_ids": s.answer.token_ids,
                    "finish_reason": s.answer.finish_reason,
                    "n_tokens": len(s.answer.token_ids),
                }
                if s.states is None:
                    self._skip(out[i], rows[i], "empty_answer")
                elif len(s.answer.token_ids) < self.min_tokens:
                    self._skip(out[i], rows[i], "too_short", self._too_short(len(s.answer.token_ids)))
                else:
                    done.append(i)
                    bags.append(s.states)
                    ids.append(s.answer.token_ids)
                    logprobs.append(s.logprobs)
            if done:
                lps = logprobs if self.answer_range is not None else None  # the sampler's own log-probs
                self._finish(done, torch.cat(bags), [len(x) for x in bags], rows, out, ids, lps, explain)

    def _finish(
        self,
        index: list[int],
        tokens: torch.Tensor,
        lengths: list[int],
        rows: list[AnswerRow],
        out: list[dict],
        answer_ids: list[list[int]],
        logprobs: list[list[float]] | None = None,
        explain: bool | None = None,
    ) -> None:
        b = self.bundle
        p_sem = None
        if b.reads.p_sem:
            p_sem = torch.tensor([rows[i].p_sem for i in index], dtype=torch.float32, device=tokens.device)
        bags = Bags(tokens, torch.as_tensor(lengths, dtype=torch.int64, device=tokens.device), p_sem)
        logits = b.seed_logits(bags).double().cpu().numpy()  # [S, B]
        if not np.isfinite(logits).all():
            self._non_finite(index, tokens, lengths, logits, rows)
        self._record(index, logits.mean(0), out)  # the ensemble's logit [B]
        for k, i in enumerate(index):
            out[i]["seed_scores"] = logits[:, k].tolist()
        if logprobs is not None:
            self._check_range(index, answer_ids, logprobs, out)
        if self.explain if explain is None else explain:
            self._explain(index, bags, answer_ids, out)

    def _record(self, index: list[int], z: np.ndarray, out: list[dict]) -> None:
        """The rows' scores z [B]: each with its calibrated probability and its flag at the threshold."""
        prob = self.bundle.probability(z)
        for k, i in enumerate(index):
            out[i] |= {"score": float(z[k]), "probability": float(prob[k]), "flag": bool(z[k] >= self.threshold)}

    def _check_range(
        self, index: list[int], answer_ids: list[list[int]], logprobs: list[list[float]], out: list[dict]
    ) -> None:
        """Each answer's token log-prob statistics, and whether they are within the fit answers' range."""
        for k, i in enumerate(index):
            stats = answer_stats(logprobs[k])
            reason = check(stats, self.answer_range)
            if reason is not None:  # name its least likely token (decoding every token costs more than the rest)
                reason = check(stats, self.answer_range, token_pieces(self.tokenizer, answer_ids[k])[stats["argmin"]])
            out[i] |= {
                "in_distribution": reason is None,
                "ood_reason": reason,
                "mean_logprob": stats["mean_logprob"],
                "min_logprob": stats["min_logprob"],
            }

    def distribution_summary(self, scored: int, out_of_distribution: int) -> dict:
        """The summary's account of the check, logging a warning when rows fall outside the range."""
        checked = self.answer_range is not None
        if checked and out_of_distribution:
            self.log(
                f"warning: {out_of_distribution} of {scored} scored row(s) are out of the detector's distribution "
                f"(in_distribution false; ood_reason says why): {self.out_of_range_means}"
            )
        return {
            "checked": checked,
            "out_of_distribution": out_of_distribution if checked else None,
            "rule": self.range_rule if checked else None,
            "note": self.range_note,
        }

    def _explain(self, index: list[int], bags: Bags, answer_ids: list[list[int]], out: list[dict]) -> None:
        """Each answer's tokens (decoded pieces, their place in the answer) and contributions."""
        e = self.bundle.evidence(bags)
        contributions = e.contributions.double().cpu().split(bags.lengths.tolist())
        for k, i in enumerate(index):
            pieces = token_pieces(self.tokenizer, answer_ids[k])
            spans = char_spans(pieces, out[i]["answer"])
            out[i] |= {
                "tokens": pieces,
                "token_start": spans.start,
                "token_end": spans.end,
                "offsets_exact": spans.exact,
                "contributions": contributions[k].tolist(),
                "bias": float(e.bias[k]),
            }

    def _non_finite(
        self, index: list[int], tokens: torch.Tensor, lengths: list[int], logits: np.ndarray, rows: list[AnswerRow]
    ) -> None:
        """Stop at the first row whose score is NaN or infinite, naming it and where it came from."""
        k = int(np.nonzero(~np.isfinite(logits).all(0))[0][0])
        r = rows[index[k]]
        start = sum(lengths[:k])
        states_finite = bool(torch.isfinite(tokens[start : start + lengths[k]]).all())
        why = (
            f"the detector's logit is {logits[:, k].tolist()} per seed on finite states (weights too large?)"
            if states_finite
            else f"the model's layer-{self.bundle.layer} states are not finite for it (an overflow in "
            f"{self.preset.dtype if self.preset else 'its dtype'}? try --dtype float32)"
        )
        raise NonFiniteScore(
            f"{r.where}{'' if r.id is None else f' (id {r.id!r})'}: its score is not a finite number: {why}. "
            "Nothing non-finite is written: the rows before it are kept for a re-run"
        )

    def fingerprint(self, **options) -> dict:
        """What a part's results depend on: any change discards parts kept from an earlier run."""
        model = self.identity["files"] or self.identity["commit"]
        return {
            "bundle": self.bundle.sha256,
            "model": model,
            "threshold": [self.threshold_name, self.threshold],
            "batch_size": self.batch_size,
            "per_seed": self.per_seed,
            "explain": self.explain,
            "distribution_check": self.answer_range is not None,
            "device": str(self.device),
            "dtype": None if self.preset is None else self.preset.dtype,
            "generate": None if self.generate is None else {**self.generate.model_dump(), "greedy": self.greedy},
            # every file scoring runs (its import closure): an edit to any of them discards the parts
            "code": code_digest(__name__),
            **options,
        }


class ScoreBundleScorer(Scorer):
    """A score bundle (score_bundle.py: a score with nothing to train) scoring rows, through the same
    rows, thresholds, calibration and output as a detector's: `p_sem` is 1 - the row's p_sem (no
    model); `length` the answer's tokens under the base model's tokenizer, as generate counts them
    (n_tokens; no weights); `logprob` minus the mean log-prob of the answer's tokens under the base
    model run teacher forced on prompt + answer (the log-probs the dump checks the generations'
    against). The scores that read the question's other answers are refused before anything loads;
    so are the options that read a detector's states or seeds. `in_distribution` says whether the
    score lies within the validation scores' range (`RANGE_RULE`)."""

    def __init__(
        self,
        bundle: ScoreBundle | str | Path,
        model=None,
        *,
        tokenizer=None,
        revision: str | None = None,
        dtype: str | None = None,
        device: str = "auto",
        device_map: str | None = None,
        positions: str | None = None,
        generate: GenerateParams | None = None,
        greedy: bool = False,
        threshold: str | float | None = None,
        batch_size: int = 32,
        per_seed: bool = False,
        explain: bool = False,
        check_distribution: bool = True,
        log=print,
    ):
        self.batch_size = at_least_one("batch_size (--batch-size)", batch_size)
        self.bundle = b = bundle if isinstance(bundle, ScoreBundle) else load_bundle(bundle)
        if not isinstance(b, ScoreBundle):
            raise UserError(f"{b.path} holds a trained '{b.method}' detector, not a score: use Scorer")
        for warning in b.warnings:
            log(f"warning: {warning}")
        if (refusal := b.refusal()) is not None:
            raise UserError(refusal)
        what = f"{b.path} is a score bundle of '{b.method}', which reads no hidden states"
        refused = {
            "--positions (positions=)": (positions is not None, f"{what}: it has no token positions"),
            "--generate (generate=)": (
                generate is not None or greedy,
                f"{what}: it scores answers given (rows with question and answer), not sampled ones",
            ),
            "--explain (explain=)": (explain, f"{what}: it has no token evidence"),
            "--per-seed (per_seed=)": (per_seed, f"{what}: nothing was trained, it has no seeds"),
        }
        if b.reads == "p_sem":  # runs no model: an option naming one would be silently ignored
            given = (model, tokenizer, revision, dtype, device_map)
            refused["--model, --revision, --dtype and --device-map"] = (
                any(x is not None for x in given),
                f"{b.path} is a score bundle of 'p_sem': it reads each row's p_sem column and runs no model",
            )
        for option, (given, why) in refused.items():
            if given:
                raise OptionError(f"{why}; drop {option}")
        self.generate, self.greedy, self.per_seed, self.explain, self.evidence_rule = None, False, False, False, None
        self.log, self.needs_p_sem, self.min_tokens = log, b.reads == "p_sem", 1
        self.threshold_name, self.threshold = b.threshold(threshold)
        self._named: Counter = Counter()
        self._loaded = False
        self.device = device if device_map else resolve_device(device, "--device")
        if b.reads == "p_sem":
            self.preset = self.model = self.tokenizer = self.vocab_size = self.context = None
            self.identity = {"path": None, "local": None, "files": None, "commit": None}
        else:
            self._setup_model(model, tokenizer, revision, dtype, device_map, None, "log-probs")
            if b.reads == "tokenizer":
                self.context = None  # counting tokens runs no model: any length is counted
        self.range_rule, self.can_score = RANGE_RULE, SCORE_CAN_SCORE
        self.out_of_range_means = (
            "their scores lie where no validation score did, so their probabilities and flags extrapolate"
        )
        self.answer_range, self.range_note = (b.meta["score_range"], None) if check_distribution else (None, None)
        if not check_distribution:
            self.range_note = "in_distribution is not checked (--no-distribution-check): every row's is null"
            log(f"note: {self.range_note}")

    def load(self) -> ScoreBundleScorer:
        """What the score reads, once: nothing (p_sem), the tokenizer (length), the whole causal LM (logprob)."""
        if self._loaded:
            return self
        if self.bundle.reads == "model":
            if self.model is None:
                self.model = load_model(self.preset, self.device)
            if getattr(self.model, "get_output_embeddings", lambda: None)() is None:
                raise UserError(
                    f"{self.bundle.path} is a score bundle of 'logprob': it needs the model's LM head for the "
                    "answers' token log-probs, and the model given has none; pass the causal LM"
                )
        if self.bundle.reads != "p_sem" and self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.preset)
        self._prompts: dict[str, list[int]] = {}
        self._loaded = True
        return self

    def score(self, rows: list[AnswerRow]) -> list[dict]:
        """One result per row, in order (columns: answer_files.output_schema)."""
        self.load()
        out = [self._blank(r, False) for r in rows]
        for o in out:
            del o["seed_scores"]
        index, z = [], []
        if self.bundle.reads == "p_sem":  # the answer is never tokenized: n_tokens stays null
            for i, r in enumerate(rows):
                out[i]["n_tokens"] = None
                if not r.answer.strip():
                    self._skip(out[i], r, "empty_answer")
                elif r.p_sem is None:
                    self._skip(out[i], r, "no_p_sem", "a 'p_sem' score bundle reads the row's p_sem and it has none")
                else:
                    index.append(i)
                    z.append(1.0 - r.p_sem)  # the score the DAG evaluated: 1 - P_sem (evaluation/baselines.py)
        elif self.bundle.reads == "tokenizer":
            todo = self._to_score(rows, out)
            index, z = [i for i, _, _ in todo], [float(len(a)) for _, _, a in todo]
        else:
            todo = self._to_score(rows, out)
            for a in range(0, len(todo), self.batch_size):
                batch = todo[a : a + self.batch_size]
                ids, mask = self._forced_inputs(batch)  # [B, W]
                with torch.no_grad():
                    logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, W, V]
                for (i, _, _), lps in zip(batch, self._answer_logprobs(batch, logits)):
                    mean = float(np.mean(lps))
                    if not np.isfinite(lps).all():
                        raise NonFiniteScore(
                            f"{rows[i].where}{'' if rows[i].id is None else f' (id {rows[i].id!r})'}: a token "
                            "log-prob of its answer is not finite (an overflow in the model's dtype? try "
                            "--dtype float32). Nothing non-finite is written: the rows before it are kept for a re-run"
                        )
                    index.append(i)
                    z.append(-mean)  # the score the DAG evaluated: minus the mean token log-prob
                    out[i] |= {"mean_logprob": mean, "min_logprob": float(np.min(lps))}
                del logits
        if index:
            self._record(index, np.asarray(z, dtype=np.float64), out)
        if self.answer_range is not None:
            for k, i in enumerate(index):
                reason = self.bundle.out_of_range(z[k])
                out[i] |= {"in_distribution": reason is None, "ood_reason": reason}
        return out

    def sample_and_score(self, *a, **k):
        raise UserError(f"{self.bundle.path} is a score bundle: it scores answers given, not sampled ones")


def make_scorer(bundle: Bundle | ScoreBundle | str | Path, model=None, **kw) -> Scorer:
    """The scorer of a bundle: a trained detector's (`Scorer`) or a score's (`ScoreBundleScorer`)."""
    b = bundle if isinstance(bundle, Bundle | ScoreBundle) else load_bundle(bundle)
    return (ScoreBundleScorer if isinstance(b, ScoreBundle) else Scorer)(b, model, **kw)


# ------------------------------------------------------------------------------ entry points
def score_answers(bundle: Bundle | str | Path, rows: Iterable[dict] | pl.DataFrame, model=None, **kw) -> pl.DataFrame:
    """Score rows in memory (dicts or a DataFrame with question, answer[, id, answer_token_ids,
    p_sem]). `kw` are `Scorer`'s options; with `generate=GenerateParams(...)` the rows hold
    questions only. Returns one row per input row (columns: answer_files.output_schema)."""
    scorer = make_scorer(bundle, model, **kw)
    records = rows.to_dicts() if isinstance(rows, pl.DataFrame) else list(rows)
    seen = RowCheck("rows", scorer.vocab_size)
    parsed = []
    for i, rec in enumerate(records):
        parsed.append(parse_row(rec, i, f"row {i}", generate=scorer.generate is not None, source="rows"))
        seen.add(parsed[-1])
    schema = output_schema(seen.id_type, scorer.generate is not None, scorer.per_seed, scorer.explain)
    df = pl.DataFrame(_shape(scorer.score(parsed), schema), schema=schema)
    scorer.distribution_summary(df["score"].count(), int((df["in_distribution"] == False).sum()))  # noqa: E712
    return df


def _shape(results: list[dict], schema: dict) -> list[dict]:
    return [{k: r.get(k) for k in schema} for r in results]


def parts_dir(output: str | Path) -> Path:
    out = Path(output)
    return out.parent / f".{out.name}.parts"


def score_file(
    bundle: Bundle | str | Path,
    input_path: str | Path,
    output_path: str | Path,
    model=None,
    *,
    rows_per_part: int = 1024,
    progress: bool = True,
    log=print,
    **kw,
) -> dict:
    """Score a JSONL or Parquet file into a Parquet or JSONL file, streamed and resumable.

    Finished parts of `rows_per_part` rows go to `.<output name>.parts/` next to the output as
    they complete; a re-run with the same bundle, input, model and options keeps them and
    scores the rest, and the output is the same as an uninterrupted run's. The output is
    written atomically at the end, then the parts are removed. Returns the run's summary.
    """
    t0 = time.perf_counter()
    rows_per_part = at_least_one("rows_per_part (--rows-per-part)", rows_per_part)
    check_output(
        output_path,
        "the output (--out)",
        {"input (--input)": input_path, "bundle (--bundle)": None if isinstance(bundle, Bundle) else bundle},
    )
    output_format(output_path)
    scorer = make_scorer(bundle, model, log=log, **kw)  # bundle and model checked, nothing loaded yet
    generate = scorer.generate is not None
    src = AnswerFile(input_path, generate=generate).check(scorer.vocab_size)  # every row, before any weights
    if scorer.needs_p_sem and not src.has_p_sem:
        what = (
            "is a score bundle of 'p_sem', 1 - each answer's P_sem"
            if isinstance(scorer, ScoreBundleScorer)
            else (f"holds a '{scorer.bundle.method}' detector, which reads each answer's P_sem")
        )
        raise UserError(
            f"{scorer.bundle.path} {what}: {input_path} has no p_sem values (add a p_sem column: "
            f"{p_sem_requirement(scorer.bundle.meta)})"
        )
    schema = output_schema(src.id_type, generate, scorer.per_seed, scorer.explain)
    n_parts = -(-src.n_rows // rows_per_part)
    store = UnitStore(
        parts_dir(output_path),
        scorer.fingerprint(input=file_sha256(input_path), rows_per_part=rows_per_part),
        busy_hint=", or write this run's scores to another --out",
    )
    kept = store.prepare()  # claims the parts: a second run on this output stops here, naming this one
    try:
        done = store.finished()
        if kept:
            log(f"resuming: {kept} of {n_parts} parts kept from an earlier run in {store.dir}")
        kept_rows = sum(min(rows_per_part, src.n_rows - u * rows_per_part) for u in done)
        if len(done) < n_parts:
            scorer.load()  # the weights, now that every check has passed
        with tqdm(total=src.n_rows, initial=kept_rows, unit="answer", desc="score", disable=not progress) as bar:
            for u, rows in src.parts(rows_per_part):
                if u in done:
                    continue
                store.put(u, pl.DataFrame(_shape(scorer.score(rows), schema), schema=schema))
                bar.update(len(rows))
        paths = store.paths(n_parts)
        write_output(paths, output_path, schema)
        counts: Counter = Counter()
        for p in paths:
            part = pl.read_parquet(p, columns=["reason", "flag", "in_distribution"])
            counts["flagged"] += int(part["flag"].sum() or 0)
            counts["out_of_distribution"] += int((part["in_distribution"] == False).sum())  # noqa: E712
            counts.update(f"reason:{r}" for r in part["reason"].drop_nulls().to_list())
    except BaseException:
        store.release()  # the finished parts stay for a re-run, unclaimed
        raise
    store.remove()  # and the claim with it
    seconds = time.perf_counter() - t0
    not_scored = {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("reason:")}
    scored = src.n_rows - sum(not_scored.values())
    summary = {
        "input": str(input_path),
        "output": str(output_path),
        "bundle": str(scorer.bundle.path),
        "kind": "score" if isinstance(scorer, ScoreBundleScorer) else "detector",
        "method": scorer.bundle.method,
        "layer": scorer.bundle.layer,
        "model": scorer.identity["path"],
        "rows": src.n_rows,
        "scored": scored,
        "flagged": counts["flagged"],
        "not_scored": not_scored,
        "in_distribution": scorer.distribution_summary(scored, counts["out_of_distribution"]),
        "can_score": scorer.can_score,
        "threshold": {"name": scorer.threshold_name, "value": scorer.threshold},
        **({"evidence": scorer.evidence_rule} if scorer.explain else {}),
        "parts_kept_from_earlier_run": kept,
        "seconds": round(seconds, 3),
        "rows_per_s": round((src.n_rows - kept_rows) / seconds, 2) if seconds > 0 else None,
    }
    log(
        f"scored {summary['scored']} of {src.n_rows} rows ({summary['flagged']} flagged at {scorer.threshold_name} = "
        f"{scorer.threshold:.4g}); not scored: {not_scored or 'none'}; out of distribution: "
        f"{counts['out_of_distribution'] if scorer.answer_range is not None else 'not checked'}"
    )
    return summary

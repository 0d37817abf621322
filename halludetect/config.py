"""Typed parameters: one section per stage, named presets, and the experiment grid.

`load_params("params.yaml")` returns a validated `Params` or raises `ParamsError` listing
every problem at once, each naming the dotted key, what was wrong, and the valid choices
("did you mean ...?" for misspelt keys). Unknown keys are errors everywhere: a typo must
never silently fall back to a default.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, Field, ValidationError, create_model, model_validator

from halludetect.core import registry, yaml12
from halludetect.core.credentials import key_variable_problem, url_credentials
from halludetect.core.errors import UserError
from halludetect.core.lookup import suggest as _suggest
from halludetect.core.sections import DEVICE, Device, Fraction, PositiveInt, PSemVariant, Section
from halludetect.methods import ANALYZABLE, METHODS, SCORES, PluginError, load_entry_points, load_factory, trained


def _split_fraction(value: float) -> float:
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"{value:g} is not a share strictly between 0 and 1: every split is needed (train fits the "
            "detectors, val picks their epoch and layer, test reports)"
        )
    return value


SplitFraction = Annotated[float, AfterValidator(_split_fraction)]
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placements over the GPUs


def device_map_problem(value: str) -> str | None:
    """Why `value` is not a device_map transformers takes as a string, or None."""
    if value in DEVICE_MAPS or DEVICE.fullmatch(value):
        return None
    return (
        f"'{value}' is not a device map; use {', '.join(DEVICE_MAPS)} (split over the GPUs), "
        "or one device (cpu, cuda, cuda:N, mps)"
    )


def _device_map(value: str | None) -> str | None:
    if value is not None and (problem := device_map_problem(value)):
        raise ValueError(problem)
    return value


def _key_variable(value: str | None) -> str | None:
    """Never a key itself; the message does not repeat the value (core/credentials.py)."""
    if value is not None and (problem := key_variable_problem(value)):
        raise ValueError(problem)
    return value


def _no_credentials(value):
    """A base URL (or a list of replicas) without a password or token in it, never echoed."""
    for url in [value] if isinstance(value, str) else value or []:
        if isinstance(url, str) and (problem := url_credentials(url)):
            raise ValueError(problem)
    return value


KeyVariable = Annotated[str | None, AfterValidator(_key_variable)]


def _seeds(value: list[int]) -> list[int]:
    if not value:
        raise ValueError("no seeds: list at least one (the paper: [0, 1, 2, 3, 4]); an empty list trains nothing")
    if len(set(value)) != len(value):
        raise ValueError(f"repeated seeds in {value}: each seed trains one detector per layer")
    return value


def _layers(value):
    if isinstance(value, list):
        if not value:
            raise ValueError("no layers: list at least one index (0 = embeddings), or write all")
        if len(set(value)) != len(value):
            raise ValueError(f"repeated layers in {value}")
    return value


def _stops(value: list[str]) -> list[str]:
    """A stop string that is empty or only spaces and tabs matches at once (answers begin with a
    space), so every answer would come back empty: refused. Newlines are real stops."""
    for s in value:
        if not s.strip(" \t"):
            raise ValueError(
                f"{s!r} is empty or only spaces/tabs: it would stop every answer before its first "
                "word; remove it (newline stops such as '\\n' are fine)"
            )
    return value


# ---------------------------------------------------------------------------- presets
class QuantizationParams(Section):
    """bitsandbytes quantization (needs a CUDA GPU). The paper's 70B: 4-bit NF4, double quantization, bf16 compute."""

    bits: Literal[4, 8]
    quant_type: Literal["nf4", "fp4"] = "nf4"  # 4-bit only
    double_quant: bool = True  # 4-bit only
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # 4-bit only


class ModelPreset(Section):
    path: str = Field(description="local directory (relative to the repo) or Hugging Face hub id")
    revision: str | None = Field(None, description="hub commit or tag; pin a commit to reproduce")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device_map: Annotated[str | None, AfterValidator(_device_map)] = Field(
        None, description="accelerate placement, e.g. 'auto' to split over GPUs"
    )
    max_memory: dict[int | str, str] | None = Field(None, description="caps for device_map: {0: 70GiB, cpu: 200GiB}")
    quantization: QuantizationParams | None = None
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None
    trust_remote_code: bool = False
    chat_template: bool = Field(False, description="wrap prompt 1 in the tokenizer's chat template")

    @model_validator(mode="after")
    def _placement(self) -> ModelPreset:
        if self.max_memory and not self.device_map:
            raise ValueError("max_memory only applies with a device_map: set device_map: auto")
        return self


def _registered(kind: str):
    """A params word naming a part of core/registry.py's `kind` (a built-in or an installed plugin),
    checked in every stage before any work, with the did-you-mean error."""

    def check(value: str) -> str:
        try:
            registry.check(kind, value)
        except KeyError as e:
            raise ValueError(str(e)) from None
        return value

    return AfterValidator(check)


class HubSource(Section):
    """Where a dataset lives on the Hugging Face hub (`datasets.load_dataset(id, config, split=split)`)."""

    id: str
    config: str | None = None
    split: str


class Md5Of(Section):
    md5: str  # the id is the md5 of this field's text (the semantic-entropy code's scheme)


class RowNumber(Section):
    row: Annotated[int, Field(ge=0)]  # the id is the record's row number, counted from this (0 or 1)


class Joined(Section):
    join: Annotated[list[str], Field(min_length=1)]  # these fields' texts, each stripped, joined by sep
    sep: str = " "


# A hub row's value for a field of the common schema: a dotted path into the row ("answer.value"), a
# list of paths whose values are concatenated (strings and lists of strings), or one of the above.
FieldSource = str | list[str] | Md5Of | RowNumber | Joined
CommonField = Literal["id", "question", "answers", "context", "incorrect_answers", "category"]


class DatasetFormat(Section):
    """How a source's records become the common schema (qa/datasets.py; docs/datasets.md): a built-in
    format is a file of halludetect/qa/formats/, a preset may write its own inline (`format:`)."""

    description: str = ""
    hub: HubSource | None = None  # None: local files only (the preset's `path`)
    fields: dict[CommonField, FieldSource] = {}  # hub rows -> common schema (question and answers at least)
    file_fields: dict[CommonField, str] = {}  # a local file's own name for a field absent under its common name
    reader: str | None = None  # "module:function" reading a local file of another shape (BioASQ's JSON)
    question_suffix: str = ""  # appended to every question (NQ-open: "?", as the peers do)
    context: Literal["keep", "drop"] = "keep"
    answers: Literal["text", "number"] = "text"  # number: 51.0 -> "51" (SVAMP)
    unanswerable: str | None = None  # drop a record without answers with this reason (else: "no reference answer")

    @model_validator(mode="after")
    def _fields(self) -> DatasetFormat:
        if self.hub is not None and not {"question", "answers"} <= set(self.fields):
            raise ValueError("a hub format maps at least question and answers in fields")
        if self.reader is not None and ":" not in self.reader:
            raise ValueError(f"reader '{self.reader}' is not 'module:function'")
        return self


def dataset_format(preset: DatasetPreset) -> DatasetFormat | None:
    """The preset's format: its own `format:`, or its loader's format file (`file` when it names none),
    validated; None for a loader that is a Python function (a plugin's)."""
    if preset.format is not None:
        return preset.format
    name = preset.loader or "file"
    target = registry.targets("dataset")[name]
    if not target.endswith(".yaml"):
        return None
    data = registry.resolve("dataset", name)
    try:
        return DatasetFormat.model_validate(data or {})
    except ValidationError as e:
        raise ParamsError(
            format_errors(e, f"the format of loader '{name}', {registry.PACKAGE_DIR / target}", DatasetFormat)
        ) from None


class SplitSizes(Section):
    """Exact question counts per split (the paper's), instead of prepare's fractions."""

    train: PositiveInt
    val: PositiveInt
    test: PositiveInt


class DatasetPreset(Section):
    loader: Annotated[str, _registered("dataset")] | None = None  # a format of core/registry.py; None: file
    format: DatasetFormat | None = Field(None, description="a format of this preset's own, instead of the loader's")
    path: str | None = Field(None, description="local file for loaders that read one")
    hf_id: str | None = None
    hf_config: str | None = None
    hf_split: str | None = None  # the hub split questions come from (val/test ones, with train_hf_split)
    revision: str | None = None
    max_questions: PositiveInt | None = None
    sizes: SplitSizes | None = Field(None, description="questions per split; None: prepare's fractions")
    train_hf_split: str | None = Field(
        None,
        description="hub split of the train questions (disjoint from the "
        "evaluation ones); None: every split from one source",
    )

    @model_validator(mode="after")
    def _path_needed(self) -> DatasetPreset:
        if self.format is not None and self.loader is not None:
            raise ValueError("format describes the dataset itself: remove loader (or format, to use the loader's)")
        fmt = dataset_format(self)
        if fmt is not None and fmt.hub is None and not self.path:
            what = f"loader '{self.loader or 'file'}'" if self.format is None else "a format without hub"
            raise ValueError(f"{what} reads a local file: set 'path'")
        if self.sizes is not None and self.max_questions is not None:
            raise ValueError("sizes fixes the number of questions: remove max_questions")
        if self.train_hf_split is not None and self.sizes is None:
            raise ValueError("train_hf_split draws exactly sizes.train questions from it: set sizes too")
        return self


# ----------------------------------------------------------------------------- stages
class WorldParams(Section):
    seed: int = 0
    n_people: PositiveInt = 400
    exposures: list[Annotated[int, Field(ge=0)]] = [0, 0, 1, 3, 10, 30]
    relations: list[str] = ["birth_city", "job", "instrument"]
    qa_fraction: Fraction = 0.5
    vocab_size: PositiveInt = 1024
    hidden_size: PositiveInt = 128
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    intermediate_size: PositiveInt = 384
    epochs: PositiveInt = 12
    batch_size: PositiveInt = 64
    lr: Annotated[float, Field(gt=0)] = 3e-3

    @model_validator(mode="after")
    def _heads_divide(self) -> WorldParams:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}")
        return self


class LookalikeParams(Section):
    """The world's second dataset, look-alike names (stage lookalike, docs/demo-world.md)."""

    seed: int = 0  # its own random stream: the look-alike names and their facts, never the world's


class MisinformedParams(Section):
    """The world's third dataset, facts the corpus got wrong (stage misinformed, docs/demo-world.md)."""

    seed: int = 0  # its own random stream: which facts were wrong, and their true values
    min_exposure: Annotated[int, Field(ge=0)] = 10  # the people the corpus names at least this often
    share: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5  # of their facts, the share the corpus got wrong


class PrepareParams(Section):
    seed: int = 0
    train: SplitFraction = 0.5
    val: SplitFraction = 0.2
    test: SplitFraction = 0.3

    @model_validator(mode="after")
    def _sum_to_one(self) -> PrepareParams:
        total = self.train + self.val + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"train + val + test must be 1, got {total:g}")
        return self


class CompletionsParams(Section):
    """An OpenAI-compatible *completions* endpoint that samples for `generate` (`backend: completions`):
    vLLM or SGLang serving the preset's model. See lm/completions.py and docs/models-and-generation.md."""

    # How requests reach the engine, and what else they bring back (hidden_states): none of these
    # changes a sample, so dvc.yaml does not declare them for `generate` and the resume fingerprint
    # leaves them out (a request for states differs from one without in its body, so their replies
    # are never mixed up).
    TRANSPORT: ClassVar[tuple[str, ...]] = (
        "base_url",
        "api_key_env",
        "concurrency",
        "max_retries",
        "timeout",
        "hidden_states",
        "states_dir",
    )

    base_url: Annotated[str | list[str] | None, AfterValidator(_no_credentials)] = Field(
        None, description="e.g. http://gpu-node:8000/v1, or a list of replicas of one model; required by completions"
    )
    model: str | None = Field(None, description="the served model name; None: the preset's path (vllm serve's default)")
    api_key_env: KeyVariable = None  # the variable holding the engine's key (vllm serve --api-key); None: no key
    concurrency: PositiveInt = 64  # requests in flight per replica
    max_retries: Annotated[int, Field(ge=0)] = 6  # on 429 (honouring Retry-After), 5xx, timeouts, cut bodies
    timeout: Annotated[float, Field(gt=0)] = 600.0  # seconds per request (a request may queue behind many)
    # question: one request per question with n = K and one seed (vLLM seeds answer i with seed + i);
    # answer: K requests with n = 1, each seeded by its answer's own stream (engines whose n ignores seeds)
    per_request: Literal["question", "answer"] = "question"
    # The layer ids a vLLM server extracts (`vllm serve ... eagle_aux_hidden_state_layer_ids`, in any
    # order: vLLM keeps them sorted, and so do we; 0 = embeddings, num_hidden_layers = the top, before
    # the final norm): each request then asks for its answer's states (`include_output_tokens`) in a
    # file it names, and generate keeps them for `dump.source: engine` (lm/engine_states.py). None: no
    # states are asked for.
    hidden_states: list[Annotated[int, Field(ge=0)]] | None = None
    # Where the engine writes those files (a RAM disk such as /dev/shm/halludetect is fastest); it must
    # be the same path on the engine's machine and generate's. None: beside the generations.
    states_dir: str | None = None

    @model_validator(mode="after")
    def _urls(self) -> CompletionsParams:
        urls = [self.base_url] if isinstance(self.base_url, str) else list(self.base_url or [])
        for url in urls:
            if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
                raise ValueError(f"base_url '{url}' is not an http(s) URL, e.g. http://gpu-node:8000/v1")
        if len(set(urls)) != len(urls):
            raise ValueError(f"base_url lists a replica twice: {urls}")
        if isinstance(self.base_url, list) and not urls:
            raise ValueError("base_url is an empty list: give one URL or a list of replicas")
        if self.hidden_states is not None and (
            not self.hidden_states or len(set(self.hidden_states)) != len(self.hidden_states)
        ):
            raise ValueError(
                f"hidden_states {self.hidden_states}: the engine's eagle_aux_hidden_state_layer_ids, each once"
            )
        return self

    @property
    def urls(self) -> list[str]:
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url or [])


class GenerateParams(Section):
    n_samples: PositiveInt = 5
    temperature: Annotated[float, Field(gt=0)] = 0.5
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0 = off
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0  # 1 = off (the paper states none)
    max_new_tokens: PositiveInt = 32
    stop: Annotated[list[str], AfterValidator(_stops)] = ["\n", "Question:"]
    empty_retries: Annotated[int, Field(ge=0)] = 3  # re-sample an empty answer at most this often
    batch_size: PositiveInt = 64  # questions per model call (x n_samples rows); also the unit of resume
    seed: int = 0
    device: Device = "auto"
    backend: Annotated[str, _registered("sampler")] = "hf"  # hf: transformers in the stage; completions: an engine
    endpoint: CompletionsParams = CompletionsParams()

    @model_validator(mode="after")
    def _endpoint_given(self) -> GenerateParams:
        if self.backend == "completions" and not self.endpoint.urls:
            raise ValueError(
                "backend completions samples through a running engine: set generate.endpoint.base_url "
                "(e.g. http://localhost:8000/v1 for `vllm serve`)"
            )
        return self


class LogprobCheckParams(Section):
    """The dump's check that the generations' log-probs are this model's (activations/logprob_check.py):
    the teacher-forced pass recomputes every answer token's log-prob from the local weights."""

    mean_tolerance: Annotated[float, Field(gt=0)] | None = 0.05  # on the mean |difference| over all tokens (nats)
    answer_tolerance: Annotated[float, Field(gt=0)] | None = 0.5  # on one answer's mean |difference| (nats)
    answer_share: Fraction = 0.01  # the share of answers that may pass answer_tolerance (a bf16 engine's outliers)


class DumpParams(Section):
    layers: Annotated[Literal["all"] | list[Annotated[int, Field(ge=0)]], AfterValidator(_layers)] = "all"
    positions: Literal["predicting", "generated"] = "predicting"
    dtype: Literal["float16", "float32"] = "float16"  # HDF5 has no bfloat16
    batch_size: PositiveInt = 64
    device: Device = "auto"
    logprob_check: LogprobCheckParams = LogprobCheckParams()
    # hf: a teacher-forced pass of the local model; engine: the states the serving engine kept while it
    # sampled (generate.endpoint.hidden_states; activations/engine_dump.py), no second model.
    source: Literal["hf", "engine"] = "hf"


class MatchJudgeParams(Section):
    lenient_recall: Fraction = 0.5


class ChatParams(Section):
    """An OpenAI-compatible chat endpoint (OpenAI, Azure's v1 URL, vLLM, Ollama); see labels/chat_client.py."""

    model: str
    base_url: Annotated[str | None, AfterValidator(_no_credentials)] = Field(
        None, description="None: the OpenAI API; vLLM e.g. http://host:8000/v1"
    )
    api_key_env: KeyVariable = Field(
        "OPENAI_API_KEY", description="environment variable holding the key; None for a local endpoint without keys"
    )
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # reasoning models take none
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # None: the endpoint's default
    max_completion_tokens: PositiveInt | None = None  # None: no cap (a reasoning model needs room to think)
    concurrency: PositiveInt = 32  # requests in flight
    max_retries: Annotated[int, Field(ge=0)] = 6  # on 429 (honouring Retry-After), 5xx, timeouts, bad bodies
    timeout: Annotated[float, Field(gt=0)] = 120.0  # seconds per request
    parse_retries: Annotated[int, Field(ge=0)] = 2  # an unparseable reply is asked again this often

    @model_validator(mode="after")
    def _reasoning(self) -> ChatParams:
        if self.reasoning_effort is not None and self.temperature is not None:
            raise ValueError("reasoning models reject a temperature: set temperature: null with reasoning_effort")
        return self


class Price(Section):
    input: Annotated[float, Field(ge=0)]  # USD per million prompt tokens
    output: Annotated[float, Field(ge=0)]  # USD per million completion tokens (reasoning tokens included)


class JudgeParams(Section):
    backend: Annotated[str, _registered("judge")] = "match"
    two_pass: bool = True
    match: MatchJudgeParams = MatchJudgeParams()
    # The paper: GPT-5 mini (a reasoning model: no temperature).
    openai: ChatParams = ChatParams(model="gpt-5-mini")


class HFNLIParams(Section):
    """An MNLI sequence classifier; labels are read from its config's id2label."""

    path: str = "microsoft/deberta-large-mnli"
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: Device = "auto"
    batch_size: PositiveInt = 64
    max_length: PositiveInt = 256
    condition_on_question: bool = False  # prefix both answers with the question (as the SE code can)
    trust_remote_code: bool = False


class ClusterParams(Section):
    backend: Annotated[str, _registered("nli")] = "exact"
    equivalence: Literal["paper", "strict"] = "paper"
    hf: HFNLIParams = HFNLIParams()
    # The paper: GPT-4o mini with prompt 3.
    openai: ChatParams = ChatParams(model="gpt-4o-mini", temperature=0.0, max_completion_tokens=16)


def is_score(name: str) -> bool:
    """A score with nothing to train (methods/scores.py), not a method trained on hidden states: the
    train and evaluate stages hand it over (stages/common.py)."""
    return name in SCORES


# One section per detector, derived from the registry in methods/ (each method, and each score with
# nothing to train, declares its params class there), so changing one detector's setting re-runs
# only that detector.
DetectorsParams = create_model(
    "DetectorsParams",
    __base__=Section,
    __doc__="One section per detector (halludetect/methods/): the trained methods and the scores.",
    **{name: (d.params, d.params()) for name, d in {**METHODS, **SCORES}.items()},
)


class TrainParams(Section):
    epochs: PositiveInt = 100
    batch_size: PositiveInt = 128
    # The paper averages five runs ([0, 1, 2, 3, 4]); the world trains three, for a standard error at
    # 3/5 of the time. Every table prints the count behind its cells.
    seeds: Annotated[list[int], AfterValidator(_seeds)] = [0, 1, 2]
    device: Device = "cpu"
    # paper: the protocol the paper states. authors: what the authors' code runs: for the logistic
    # loss their pooling code's extras (positive-class weight 0.3, ReduceLROnPlateau on the validation
    # loss, drop_last), for HaMI's MIL loss the HaMI code's loop (128 + 128 answers per step, its
    # per-step schedule on the training loss, a step per epoch); detectors/loop.py.
    recipe: Literal["paper", "authors"] = "paper"


class EvaluateParams(Section):
    bootstrap: Annotated[int, Field(ge=0)] = 1000  # resamples of test questions for the AUROC interval
    seed: int = 0
    throughput_repeats: PositiveInt = 5  # best of this many timed passes
    device: Device = "auto"  # where throughput is timed (auto: CUDA when there is one; CUDA timings synchronised)


class LatencyParams(Section):
    """HaMI (SP)'s cost one response at a time (stage latency): real sampling and NLI calls."""

    questions: PositiveInt = 8  # test questions timed one at a time
    device: Device = "auto"


class AnalyzeParams(Section):
    """The sensitivity analysis of HaMI detectors (stage analyze; halludetect/evaluation/analysis.py)."""

    steps: PositiveInt = 1000  # N midpoint steps of the path integral C_B^int (the paper's)
    layers: list[Annotated[int, Field(ge=0)]] = []  # analysed besides the best layer (chosen on validation)
    splits: list[Literal["train", "val", "test"]] = ["train", "test"]  # the paper's appendix: train and test
    # HaMI is trained without scaling: it is analysed under the scaling HaMI (SP) would apply.
    hami_lam: Annotated[float, Field(gt=0)] = 1.0  # the paper's lambda
    hami_p_sem: PSemVariant = "sum"  # the paper's formula
    bins: PositiveInt = 40  # histogram bins of the distribution plots
    # A warning (log, JSON, table note) when the path identity Z(p_B) = Z(0) - p_B C_B^int misses
    # by more than this, in logits, on any bag: the N steps are too few for the network's kinks.
    path_tolerance: Annotated[float, Field(gt=0)] = 0.01


def threshold_name(target_fpr: float) -> str:
    """The name of a bundle's threshold at a target false-positive rate: fpr_0.05, ..."""
    return f"fpr_{target_fpr:g}"


def _target_fpr(value: float) -> float:
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"{value:g} is not a target false-positive rate strictly between 0 and 1; e.g. 0.05: at most "
            "one correct validation answer in twenty flagged"
        )
    return value


TargetFPR = Annotated[float, AfterValidator(_target_fpr)]


def _threshold_choice(value: str) -> str:
    """best_f1, or fpr_<rate> with a rate in (0, 1), spelt as the bundle names it (fpr_0.050 -> fpr_0.05)."""
    if value == "best_f1":
        return value
    rate = value.removeprefix("fpr_")
    try:
        target = float(rate) if value.startswith("fpr_") else None
    except ValueError:
        target = None
    if target is None:
        raise ValueError(
            f"'{value}' is neither fpr_<rate> (the lowest validation logit whose false-positive rate is at "
            "most <rate>, e.g. fpr_0.05) nor best_f1"
        )
    try:
        return threshold_name(_target_fpr(target))
    except ValueError as e:
        raise ValueError(f"'{value}': {e}") from None


class TransferParams(Section):
    """Cross-dataset transfer (stage transfer; the pairs are grid.transfer's)."""

    ece_bins: PositiveInt = 10  # equal-width probability bins of the calibration error


class ExportParams(Section):
    """The detector bundle of each evaluated method's best layer (stage export; `halludetect score` reads it)."""

    # The bundle's default flag (docs/scoring.md, "Flag thresholds"): fpr_<rate>, the lowest
    # validation logit whose false-positive rate is at most <rate>, or best_f1. 5%: a flag a
    # person acts on should rarely fire on a correct answer (one in twenty), and validation can
    # place it (1% rests on a handful of correct answers); best F1 counts a false alarm like a
    # missed hallucination and flags many correct answers where hallucinations are common.
    threshold: Annotated[str, AfterValidator(_threshold_choice)] = "fpr_0.05"
    fpr_targets: list[TargetFPR] = [0.01, 0.05, 0.1]  # also stored, for --threshold (export.threshold's is added)


class ReportParams(Section):
    """The tables (stage report)."""

    # A dataset whose prompt holds a reference answer for more than this share of its questions
    # (prepare's leak check, metrics/prepare/<d>.json) is marked in every table: the model can copy
    # the answer, so the similarity baselines are trivially strong there. 0.1: the paper's four
    # datasets and the three below measure 0.4% to 8.8% on the shared samples, incidental matches
    # (an alias in the question, one of two names a comparison question offers).
    leak_threshold: Annotated[float, Field(ge=0, le=1)] = 0.1


def _flow(items: list) -> str:
    return "[" + ", ".join(str(x) for x in items) + "]"


class GridParams(Section):
    models: list[str]
    datasets: list[str]
    # Layers trained and evaluated (one train stage each); they must have been dumped (dump.layers).
    layers: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    # Every detector (train@, evaluate@): the methods trained on hidden states and the scores with
    # nothing to train (methods/scores.py). The route stage hands each what it reads besides the
    # states: the clustering (hami_sp, sep_*, p_sem, ...), the model preset (p_true).
    detectors: list[str]
    analyze: list[str] = []  # HaMI-family detectors whose sensitivity to the scaling is analysed (analyze@)
    # Cross-dataset transfer (stage transfer@<m>-<train>-<test>, docs/transfer.md): the datasets whose
    # every ordered pair, the diagonal included, is evaluated within each model; [] for none. dvc.yaml's
    # matrix expands the pairs itself, so this list is all there is to write.
    transfer: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _transfer_of_before(cls, data):
        """The former forms (`off`, `all`, [train, test] pairs, and the derived `transfer_stages`)
        get a message saying what to write instead, not pydantic's type errors."""
        if not isinstance(data, dict):
            return data
        if former := [k for k in ("baselines", "model_baselines") if k in data]:
            names = [*(data.get("detectors") or []), *(n for k in former for n in (data.get(k) or []))]
            them = "them" if len(former) > 1 else "it"
            raise ValueError(
                f"grid.{' and grid.'.join(former)}: the scores with nothing to train are detectors now, in the one "
                f"list grid.detectors (their settings under detectors.<name>): delete {them} and write "
                f"`detectors: {_flow(names)}`"
            )
        if former := [k for k in ("methods", "sp_methods") if k in data]:
            names = [n for k in ("methods", "sp_methods") for n in (data.get(k) or [])]
            raise ValueError(
                f"grid.{' and grid.'.join(former)}: the detectors are one list now, grid.detectors (the route stage "
                f"hands the clustering to those that read it): replace {'them' if len(former) > 1 else 'it'} with "
                f"`detectors: {_flow(names)}`"
            )
        if "transfer_stages" in data:
            raise ValueError(
                "grid.transfer_stages is gone: delete it (dvc.yaml's matrix now expands grid.transfer's pairs "
                "itself; grid.transfer lists the datasets whose ordered pairs are evaluated)"
            )
        value = data.get("transfer")
        if value in ("off", "all", False) or (isinstance(value, list) and any(isinstance(v, list) for v in value)):
            datasets = data.get("datasets") or []
            raise ValueError(
                f"grid.transfer: {value!r} is the former form; write the datasets whose ordered pairs (the "
                f"diagonal included) are evaluated: [] for none, {_flow(datasets)} for all of grid.datasets"
            )
        return data

    def transfer_pairs(self) -> list[tuple[str, str]]:
        """The ordered (train, test) pairs of grid.transfer's datasets, the diagonal included, in
        grid.transfer's order (dvc.yaml's matrix runs over the same two lists)."""
        return [(a, b) for a in self.transfer for b in self.transfer]


class Params(Section):
    grid: GridParams
    models: dict[str, ModelPreset]
    datasets: dict[str, DatasetPreset]
    world: WorldParams = WorldParams()
    lookalike: LookalikeParams = LookalikeParams()
    misinformed: MisinformedParams = MisinformedParams()
    prepare: PrepareParams = PrepareParams()
    generate: GenerateParams = GenerateParams()
    dump: DumpParams = DumpParams()
    judge: JudgeParams = JudgeParams()
    cluster: ClusterParams = ClusterParams()
    prices: dict[str, Price] = {}  # by model name, for the cost estimate in the judge and cluster metrics
    detectors: DetectorsParams = DetectorsParams()
    train: TrainParams = TrainParams()
    evaluate: EvaluateParams = EvaluateParams()
    export: ExportParams = ExportParams()
    transfer: TransferParams = TransferParams()
    latency: LatencyParams = LatencyParams()
    analyze: AnalyzeParams = AnalyzeParams()
    report: ReportParams = ReportParams()

    # The scores' former sections, now each score's own under detectors (so that a setting of one
    # re-runs that score alone): where each key went.
    FORMER_SECTIONS: ClassVar[dict[str, str]] = {
        "baselines": "baselines.p_sem is detectors.p_sem.variant, baselines.semantic_entropy "
        "detectors.semantic_entropy.variant",
        "p_true": "its keys (few_shot, batch_size, device) are under detectors.p_true",
    }

    @model_validator(mode="before")
    @classmethod
    def _former_sections(cls, data):
        if isinstance(data, dict) and (former := [k for k in cls.FORMER_SECTIONS if k in data]):
            raise ValueError(
                "; ".join(f"the section '{k}' is gone: {cls.FORMER_SECTIONS[k]}" for k in former)
                + " (the scores are detectors now: docs/detectors.md)"
            )
        return data

    @model_validator(mode="after")
    def _grid_names_exist(self) -> Params:
        problems = []
        for key, names, choices in (
            ("grid.models", self.grid.models, self.models),
            ("grid.datasets", self.grid.datasets, self.datasets),
            ("grid.detectors", self.grid.detectors, [*METHODS, *SCORES]),
            ("grid.analyze", self.grid.analyze, ANALYZABLE),
        ):
            for name in names:
                if name not in choices:
                    problems.append(f"{key}: '{name}' is not defined{_suggest(name, choices)}")
                elif key == "grid.analyze" and name not in self.grid.detectors:
                    problems.append(
                        f"grid.analyze: '{name}' is analysed from its trained detectors: list it under "
                        "grid.detectors too"
                    )
            if len(set(names)) != len(names):
                problems.append(f"{key}: {_flow(names)} lists a name twice")
        if not trained(self.grid.detectors):
            problems.append(
                "grid.detectors: no detector trained on hidden states (every figure and the token evidence of a "
                "cell are drawn from one at least): add one, e.g. hami or max"
            )
        for section, presets in (("models", self.models), ("datasets", self.datasets)):
            for name in presets:
                if "." in name:  # dvc.yaml declares `models.${item.model}`: DVC would read nested keys
                    problems.append(
                        f"{section}: preset name '{name}' contains '.', which DVC reads as nesting in "
                        f"dvc.yaml's params ({section}.{name}); rename it, e.g. "
                        f"'{name.replace('.', '_')}'"
                    )
        for name in self.grid.detectors:
            m = METHODS.get(name)
            if m is not None and self.dump.positions not in m.reads.positions:
                problems.append(
                    f"grid: '{name}' reads a state that a '{self.dump.positions}' bag does not hold: set "
                    f"dump.positions: {m.reads.positions[0]} or drop it from the grid"
                )
        if self.dump.source == "engine":
            ep = self.generate.endpoint
            if self.generate.backend != "completions" or ep.hidden_states is None or ep.per_request != "answer":
                problems.append(
                    "dump.source: engine writes the states a vLLM server kept while it sampled: set "
                    "generate.backend: completions, generate.endpoint.per_request: answer (one states file per "
                    "answer) and generate.endpoint.hidden_states to the layer ids the server extracts "
                    '(docs/models-and-generation.md, "States from the engine"); or dump.source: hf'
                )
        if "transfer" in self.grid.datasets:
            problems.append(
                "grid.datasets: a dataset preset named 'transfer' would share metrics/eval/<model>/transfer/ with "
                "the transfer stage's results: rename the preset"
            )
        if bad := [d for d in self.grid.transfer if d not in self.grid.datasets]:
            problems.append(
                f"grid.transfer: {bad} not in grid.datasets {self.grid.datasets}: add them there or drop them "
                "from grid.transfer"
            )
        if len(set(self.grid.transfer)) != len(self.grid.transfer):
            problems.append(f"grid.transfer: {self.grid.transfer} lists a dataset twice")
        if len(set(self.grid.layers)) != len(self.grid.layers):
            problems.append(f"grid.layers: {self.grid.layers} lists a layer twice")
        if untrained := sorted(set(self.analyze.layers) - set(self.grid.layers)):
            problems.append(
                f"analyze.layers: {untrained} are not trained (grid.layers is {self.grid.layers}); "
                "add them to grid.layers or drop them from analyze.layers"
            )
        if self.dump.layers != "all" and (undumped := sorted(set(self.grid.layers) - set(self.dump.layers))):
            problems.append(
                f"grid.layers: {undumped} are not dumped (dump.layers is {self.dump.layers}); "
                "add them to dump.layers or drop them from grid.layers"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def model(self, name: str) -> ModelPreset:
        return _lookup("models", name, self.models)

    def dataset(self, name: str) -> DatasetPreset:
        return _lookup("datasets", name, self.datasets)


class ParamsError(UserError, ValueError):
    """Every problem in a params file, one per line, each naming its dotted key."""


def _lookup(section: str, name: str, presets: dict):
    if name not in presets:
        raise ParamsError(f"{section}: no preset named '{name}'{_suggest(name, presets)}")
    return presets[name]


def _model_at(loc: tuple, root: type[BaseModel] | None = None) -> type[BaseModel] | None:
    """The pydantic model owning the keys at `loc`, following fields and dict values."""
    model: Any = root or Params
    for part in loc:
        model = _section_of(model)
        if isinstance(model, type) and issubclass(model, BaseModel) and part in model.model_fields:
            model = model.model_fields[part].annotation
        elif get_origin(model) is dict:
            model = get_args(model)[1]  # a preset name: step into the dict's value type
        else:
            return None
    model = _section_of(model)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _section_of(annotation: Any) -> Any:
    """An optional section's model (X | None -> X); any other annotation as it is."""
    if get_origin(annotation) in (Union, UnionType):
        return next((a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)), annotation)
    return annotation


# What looks like a credential pasted into a field: a known key's prefix, or a long run of key characters.
SECRET_LIKE = re.compile(
    r"(sk-|sk_|hf_|ghp_|gho_|ghs_|github_pat_|xox[abpr]-|AKIA|ASIA|AIza|glpat-)[A-Za-z0-9_\-]{4,}"
    r"|[A-Za-z0-9_\-+/=]{32,}"
)


def _shown(value: Any) -> str:
    """A refused value as an error message shows it, anything that looks like a key hidden."""
    return SECRET_LIKE.sub("<hidden: looks like a key>", repr(value))


def format_errors(err: ValidationError, source: str, root: type[BaseModel] | None = None) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in ("function-after",))
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1], root)
            valid = sorted(owner.model_fields) if owner else []
            lines.append(f"{key}: unknown key{_suggest(str(loc[-1]), valid)}")
        elif e["type"] == "missing":
            lines.append(f"{key}: required key is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(
                f"{key}: {msg} (got {_shown(e.get('input'))})" if e["type"] != "value_error" else f"{key}: {msg}"
            )
    return f"{source}: {len(lines)} problem(s)\n  " + "\n  ".join(lines)


def _plugin_sections(data: dict, source: str) -> dict:
    """Register the installed plugins (entry points) and the methods params.yaml declares with
    `detectors.<name>.factory: module:factory` (methods/plugins.py); returns `data` without the
    factory keys, which belong to no params class."""
    load_entry_points()
    detectors = data.get("detectors")
    if not isinstance(detectors, dict):
        return data
    problems, clean = [], {}
    for name, section in detectors.items():
        if isinstance(section, dict) and "factory" in section:
            try:
                load_factory(str(name), section["factory"])
            except PluginError as e:
                problems.append(str(e))
            section = {k: v for k, v in section.items() if k != "factory"}
        clean[name] = section
    if problems:
        raise ParamsError(f"{source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems))
    return {**data, "detectors": clean}


_MODELS: dict[tuple[str, ...], type[Params]] = {}


def params_model() -> type[Params]:
    """`Params`, with a section for every method registered since this module was imported (plugins)."""
    extra = tuple(n for n in METHODS if n not in DetectorsParams.model_fields)
    if not extra:
        return Params
    if extra not in _MODELS:
        fields = {}
        for n in extra:
            cls = METHODS[n].params
            try:
                fields[n] = (cls, cls())
            except ValidationError:  # a params class without defaults: its section is required
                fields[n] = (cls, ...)
        sections = create_model("DetectorsParams", __base__=DetectorsParams, **fields)
        _MODELS[extra] = create_model("Params", __base__=Params, detectors=(sections, ...))
    return _MODELS[extra]


def parse_params(data: dict, source: str = "params") -> Params:
    data = _plugin_sections(data, source)
    model = params_model()
    if model is not Params and "detectors" not in data:
        data = {**data, "detectors": {}}
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ParamsError(format_errors(err, source, model)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: no such params file (run from the repository root)")
    try:
        data = yaml12.load(path.read_text()) or {}  # as DVC reads it: `off` stays a word (core/yaml12.py)
    except yaml12.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ParamsError(
            f"{at}: YAML syntax error: {e.problem or e.context} (check the indentation and quoting "
            "at that line, or the line before it)"
        ) from None
    except yaml12.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    return parse_params(data, str(path))

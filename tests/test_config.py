"""Typed params (halludetect/config.py): the shipped params are valid; unknown keys, wrong types, bad
choices, undefined grid names, dotted preset names and cross-field problems are named with their
dotted key and a suggestion, every problem at once; the export's default threshold is a target
false-positive rate (best F1 selectable); and the hostile cases, an empty stop string, a zero split
share, no seeds, no layers, a YAML syntax error (file, line and column), an unknown device and a
target false-positive rate outside (0, 1), each named with its key; a key pasted as api_key_env and
credentials in a base_url, refused without repeating them."""

import re

import pytest
from support import ROOT, base_params, stage
from support import base_params as base

from halludetect.config import ParamsError, load_params, parse_params


def test_shipped_params_are_valid():
    p = load_params("params.yaml")
    assert p.grid.models == ["world"] and p.model("world").path == "data/world/model"


def test_unknown_key_names_key_and_suggests():
    data = base()
    data["generate"]["temprature"] = 0.7
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "generate.temprature: unknown key" in msg and "did you mean 'temperature'" in msg
    assert "max_new_tokens" in msg  # lists the valid keys


def test_unknown_key_in_preset_and_nested_section():
    data = base()
    data["models"]["world"]["dtyp"] = "float32"
    data["detectors"]["max"]["dimm"] = 3
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "models.world.dtyp: unknown key; did you mean 'dtype'" in msg
    assert "detectors.max.dimm: unknown key; did you mean 'dim'" in msg
    assert "2 problem(s)" in msg  # every problem at once


def test_wrong_type_and_bad_choice():
    data = base()
    data["generate"]["n_samples"] = "five"
    data["dump"]["positions"] = "middle"
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "generate.n_samples" in msg and "'five'" in msg
    assert "dump.positions" in msg and "predicting" in msg


def test_grid_names_must_exist():
    data = base()
    data["grid"]["detectors"] = ["maxx"]
    data["grid"]["datasets"] = ["triviaqa"]
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "'maxx' is not defined; did you mean 'max'?" in msg
    assert "'triviaqa' is not defined; did you mean 'trivia_qa'?" in msg


def test_a_preset_name_with_a_dot_is_refused_before_dvc_misreads_it():
    """dvc.yaml declares `models.${item.model}`; DVC reads `models.llama3.3-70b` as nested keys."""
    data = base()
    data["models"]["llama3.3-70b"] = data["models"].pop("llama3_3-70b")
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    assert "models: preset name 'llama3.3-70b' contains '.'" in str(e.value)
    assert "e.g. 'llama3_3-70b'" in str(e.value)


def test_cross_field_checks():
    data = base()
    data["prepare"]["test"] = 0.5
    data["world"]["n_heads"] = 5
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "train + val + test must be 1" in msg and "not divisible by n_heads 5" in msg


def test_missing_params_file(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")


def test_unknown_preset_lookup():
    p = load_params("params.yaml")
    with pytest.raises(ParamsError, match="did you mean 'llama3-8b'"):
        p.model("llama3-7b")


def test_export_threshold_is_a_false_positive_rate_by_default_and_best_f1_stays_selectable():
    params = load_params("params.yaml")
    assert params.export.threshold == "fpr_0.05" and params.export.fpr_targets == [0.01, 0.05, 0.1]

    def export(**section):
        return parse_params(base_params() | {"export": section}).export

    assert export(threshold="best_f1").threshold == "best_f1"
    assert export(threshold="fpr_0.010").threshold == "fpr_0.01"  # spelt as the bundle names it
    assert export(fpr_targets=[0.05], threshold="fpr_0.2").threshold == "fpr_0.2"  # stored beside the targets


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"threshold": "fpr_1.5"}, "export.threshold: 'fpr_1.5': 1.5 is not a target false-positive rate strictly"),
        ({"threshold": "fpr_0"}, "export.threshold: 'fpr_0': 0 is not a target false-positive rate strictly between"),
        ({"threshold": "fpr_nan"}, "export.threshold: 'fpr_nan': nan is not a target false-positive rate"),
        ({"fpr_targets": [0.05, 1]}, "export.fpr_targets.1: 1 is not a target false-positive rate strictly between 0"),
        ({"fpr_targets": [-0.1]}, "export.fpr_targets.0: -0.1 is not a target false-positive rate strictly between"),
        ({"threshold": "f1"}, "export.threshold: 'f1' is neither fpr_<rate> (the lowest validation logit whose"),
    ],
)
def test_a_target_false_positive_rate_outside_0_1_is_a_params_error_naming_the_key(section, message):
    msg = params_error(lambda d: d.update(export=section))
    assert message in msg


# ------------------------------------------------------------------------ hostile params
def params_error(update) -> str:
    data = base_params()
    update(data)
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    return str(e.value)


@pytest.mark.hostile
def test_params_reject_an_empty_stop_string_naming_the_key():
    msg = params_error(lambda d: d["generate"].update(stop=["\n", ""]))
    assert "generate.stop: '' is empty or only spaces/tabs: it would stop every answer before its first word" in msg
    assert "generate.stop: ' ' is empty" in params_error(lambda d: d["generate"].update(stop=[" "]))
    data = base_params()
    data["generate"]["stop"] = ["\n", "\n\n", "Question:"]  # newline stops are real stops
    assert parse_params(data).generate.stop == ["\n", "\n\n", "Question:"]


@pytest.mark.hostile
def test_params_reject_a_zero_split_fraction_naming_the_key():
    msg = params_error(lambda d: d["prepare"].update(val=0, test=0.5))  # still sums to 1
    assert (
        "prepare.val: 0 is not a share strictly between 0 and 1: every split is needed (train fits the "
        "detectors, val picks their epoch and layer, test reports)"
    ) in msg


@pytest.mark.hostile
def test_params_reject_empty_train_seeds_naming_the_key():
    msg = params_error(lambda d: d["train"].update(seeds=[]))
    assert "train.seeds: no seeds: list at least one (the paper: [0, 1, 2, 3, 4]); an empty list trains nothing" in msg


@pytest.mark.hostile
def test_params_reject_empty_dump_layers_naming_the_key():
    msg = params_error(lambda d: d["dump"].update(layers=[]))
    assert "dump.layers: no layers: list at least one index (0 = embeddings), or write all" in msg


@pytest.mark.hostile
def test_params_yaml_syntax_error_names_file_line_and_column(tmp_path):
    text = (
        (ROOT / "params.yaml")
        .read_text()
        .replace("prepare:\n  seed: 0\n  train: 0.5", "prepare:\n  seed: 0\n train: 0.5")
    )
    path = tmp_path / "params.yaml"
    path.write_text(text)
    line = text.splitlines().index(" train: 0.5") + 1
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert str(e.value).startswith(f"{path}:{line}:2: YAML syntax error: ")
    res = stage(
        "stages.prepare",
        "--params",
        str(path),
        "--dataset",
        "world",
        "--out",
        str(tmp_path / "q.parquet"),
        "--metrics",
        str(tmp_path / "m.json"),
    )
    assert res.returncode == 2 and f"error: {path}:{line}:2: YAML syntax error" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.hostile
def test_params_rewritten_by_dvc_keep_their_words(tmp_path):
    """`dvc exp run -S` rewrites the whole params.yaml as YAML 1.2 and drops the quotes that 1.2 does
    not need: a dataset preset named `no` (Norwegian's code), written `'no'`, comes back as `no`, which
    YAML 1.1 (PyYAML) reads as False, as it read the former `transfer: 'off'` (every stage of the
    experiment failed). Written by DVC's own writer, as -S does."""
    from dvc.utils.serialize import modify_yaml

    path = tmp_path / "params.yaml"
    path.write_text((ROOT / "params.yaml").read_text())
    with modify_yaml(path) as data:
        data["datasets"]["no"] = dict(data["datasets"]["world"])
        data["grid"]["datasets"] = ["world", "no"]
        data["grid"]["transfer"] = ["no"]
        data["detectors"]["max"]["dim"] = 8  # the swept key
    assert "\n  - no\n" in path.read_text() and "\n  no:\n" in path.read_text()  # unquoted, as DVC writes them
    p = load_params(path)
    assert p.grid.datasets == ["world", "no"] and "no" in p.datasets and p.grid.transfer == ["no"]
    assert p.grid.transfer_pairs() == [("no", "no")] and p.detectors.max.dim == 8


@pytest.mark.hostile
def test_params_yaml_duplicate_keys_are_an_error_naming_the_line(tmp_path):
    """PyYAML kept the last of two equal keys silently; a second `epochs:` is a mistake to name."""
    text = (ROOT / "params.yaml").read_text().replace("  epochs: 100\n", "  epochs: 100\n  epochs: 10\n", 1)
    path = tmp_path / "params.yaml"
    path.write_text(text)
    line = text.splitlines().index("  epochs: 10") + 1
    with pytest.raises(ParamsError, match=rf"^{re.escape(str(path))}:{line}:3: YAML syntax error: found duplicate key"):
        load_params(path)


@pytest.mark.hostile
def test_params_reject_an_unknown_device_naming_the_key():
    msg = params_error(lambda d: [d["generate"].update(device="banana"), d["train"].update(device="gpu")])
    assert "generate.device: 'banana' is not a device; use auto, cpu, cuda, cuda:N (a GPU index) or mps" in msg
    assert "train.device: 'gpu' is not a device" in msg
    data = base_params()
    data["dump"]["device"], data["cluster"]["hf"]["device"], data["train"]["device"] = "cuda:1", "mps", "cuda"
    parse_params(data)  # real devices pass


def test_grid_transfer_is_every_ordered_pair_of_its_datasets():
    p = load_params("params.yaml")
    assert p.grid.transfer == p.grid.datasets
    assert p.grid.transfer_pairs() == [(a, b) for a in p.grid.datasets for b in p.grid.datasets]
    data = base()
    data["grid"]["datasets"] = ["world", "world_lookalike", "trivia_qa"]
    data["grid"]["transfer"] = ["trivia_qa", "world"]
    assert parse_params(data).grid.transfer_pairs() == [
        ("trivia_qa", "trivia_qa"),
        ("trivia_qa", "world"),
        ("world", "trivia_qa"),
        ("world", "world"),
    ]
    data["grid"]["transfer"] = []
    assert parse_params(data).grid.transfer_pairs() == []


@pytest.mark.hostile
@pytest.mark.parametrize("former", ["off", "all", [["world", "world"]]])
def test_the_former_transfer_forms_say_what_to_write_instead(former):
    data = base()
    data["grid"]["transfer"] = former
    with pytest.raises(ParamsError, match=r"grid.transfer: .* is the former form; write the datasets .*\[\] for none"):
        parse_params(data)
    data["grid"]["transfer"] = []
    data["grid"]["transfer_stages"] = {}
    with pytest.raises(ParamsError, match=r"grid.transfer_stages is gone: delete it"):
        parse_params(data)


@pytest.mark.hostile
def test_transfer_naming_a_dataset_not_in_the_grid_or_twice():
    data = base()
    data["grid"]["transfer"] = ["world", "trivia_qa"]
    with pytest.raises(ParamsError, match=r"grid.transfer: \['trivia_qa'\] not in grid.datasets"):
        parse_params(data)
    data["grid"]["transfer"] = ["world", "world"]
    with pytest.raises(ParamsError, match=r"lists a dataset twice"):
        parse_params(data)


def test_a_dataset_named_transfer_is_refused():
    data = base()
    data["datasets"]["transfer"] = data["datasets"]["world"]
    data["grid"]["datasets"] = ["transfer"]
    data["grid"]["transfer"] = []
    with pytest.raises(
        ParamsError, match="a dataset preset named 'transfer' would share metrics/eval/<model>/transfer/"
    ):
        parse_params(data)


# ------------------------------------------------------------------------ secrets in params
# The sections that name an endpoint: the judge, the NLI backend, the sampling engine.
ENDPOINTS = ["judge.openai", "cluster.openai", "generate.endpoint"]
# An OpenAI-style key, and a key that is also a valid shell name (only its look gives it away).
PASTED = ["sk-test-0123456789abcdef", "hf_AbCdEfGh1234IjKlMnOp5678QrStUv"]


def _section(data: dict, dotted: str) -> dict:
    for part in dotted.split("."):
        data = data[part]
    return data


@pytest.mark.hostile
@pytest.mark.parametrize("pasted", PASTED, ids=["sk", "shell_name_shaped"])
@pytest.mark.parametrize("where", ENDPOINTS)
def test_a_key_pasted_as_api_key_env_is_refused_without_repeating_it(where, pasted):
    data = base()
    _section(data, where)["api_key_env"] = pasted
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert pasted not in msg
    assert f"{where}.api_key_env: not the name of an environment variable (it may be a key itself" in msg
    assert "The key goes in the environment (export OPENAI_API_KEY=...) and api_key_env names the variable" in msg
    _section(data, where)["api_key_env"] = "MY_TEAM_KEY_2"  # a name, even with a digit
    parse_params(data)


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("url", "found"),
    [
        ("https://me:{key}@api.example.com/v1", "carries a user name or password before the host (user:password@)"),
        ("http://gpu-node:8000/v1?api_key={key}", "carries a credential in its query (parameter 'api_key')"),
        ("http://gpu-node:8000/v1?{key}", "carries a credential in its query, not repeated here"),
    ],
    ids=["userinfo", "query_parameter", "bare_query"],
)
@pytest.mark.parametrize("where", ENDPOINTS)
def test_credentials_in_a_base_url_are_refused_naming_the_key_without_repeating_them(where, url, found):
    key = "sk-test-0123456789abcdef"
    data = base()
    section = _section(data, where)
    section["base_url"] = url.format(key=key)
    if where == "generate.endpoint":  # a list of replicas is checked too
        section["base_url"] = ["http://gpu-a:8000/v1", url.format(key=key)]
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert key not in msg and "me:" not in msg
    assert f"{where}.base_url: {found}" in msg and "name that variable in api_key_env" in msg
    section["base_url"] = "https://my-resource.openai.azure.com/openai/v1/?api-version=preview"  # no secret
    parse_params(data)


@pytest.mark.hostile
def test_params_reject_an_unknown_device_map_naming_the_key():
    data = base()
    data["models"]["world"]["device_map"] = "banana"
    with pytest.raises(ParamsError, match=r"models.world.device_map: 'banana' is not a device map; use auto, "):
        parse_params(data)
    for placement in ("auto", "balanced_low_0", "sequential", "cpu", "cuda:1"):
        data["models"]["world"]["device_map"] = placement
        parse_params(data)


@pytest.mark.hostile
def test_the_former_method_lists_name_the_one_list_to_write_instead():
    data = base()
    grid = data["grid"]
    grid["methods"], grid["sp_methods"] = ["hami", "max"], ["hami_sp"]
    del grid["detectors"]
    with pytest.raises(ParamsError, match=r"grid.methods and grid.sp_methods: the detectors are one list now") as e:
        parse_params(data)
    assert "`detectors: [hami, max, hami_sp]`" in str(e.value)


@pytest.mark.hostile
def test_a_detector_listed_twice_misspelt_or_analysed_untrained_is_refused_and_scores_are_detectors():
    data = base()
    data["grid"]["detectors"] = ["max", "hami", "max", "p_true", "logprob", "psem"]
    data["grid"]["analyze"] = ["hami_sp"]
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "grid.detectors: [max, hami, max, p_true, logprob, psem] lists a name twice" in msg
    assert "grid.detectors: 'psem' is not defined; did you mean 'p_sem'?" in msg
    assert "p_true'" not in msg and "logprob'" not in msg  # the scores with nothing to train are detectors
    assert "grid.analyze: 'hami_sp' is analysed from its trained detectors: list it under grid.detectors" in msg
    data["grid"].update(detectors=["hami", "p_true", "logprob"], analyze=[])
    data["detectors"] = {"p_true": {"few_shot": 2}, "p_sem": {"variant": "mean"}}
    p = parse_params(data)
    assert p.detectors.p_true.few_shot == 2 and p.detectors.p_sem.variant == "mean"
    assert p.detectors.semantic_entropy.variant == "mean" and p.detectors.length.model_dump() == {}
    data["grid"].update(detectors=["p_true", "logprob"])  # the figures and the evidence need a trained one
    with pytest.raises(ParamsError, match="grid.detectors: no detector trained on hidden states .*: add one"):
        parse_params(data)


@pytest.mark.hostile
def test_the_former_score_lists_and_sections_name_where_they_went():
    data = base()
    data["grid"].update(baselines=["p_sem", "length"], model_baselines=["p_true"])
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "grid.baselines and grid.model_baselines: the scores with nothing to train are detectors now" in msg
    assert f"`detectors: [{', '.join([*base()['grid']['detectors'], 'p_sem', 'length', 'p_true'])}]`" in msg
    data = base()
    data.update(baselines={"p_sem": "mean"}, p_true={"few_shot": 3})
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "the section 'baselines' is gone: baselines.p_sem is detectors.p_sem.variant" in msg
    assert "the section 'p_true' is gone: its keys (few_shot, batch_size, device) are under detectors.p_true" in msg
    data = base()
    data["detectors"] = {"p_true": {"device": "gpu"}, "length": {"k": 1}}
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    assert "detectors.p_true.device" in str(e.value) and "detectors.length.k" in str(e.value)


@pytest.mark.hostile
@pytest.mark.parametrize(
    "where, value, says",
    [
        (("world", "lr"), True, "world.lr: true or false where a number is meant"),
        (("world", "lr"), float("inf"), "world.lr: Input should be a finite number"),
        (("world", "lr"), float("nan"), "world.lr: Input should be a finite number"),
        (("train", "seeds"), [True, False], "train.seeds: true or false where a number is meant"),
        (("world", "lr"), "sk-proj-AbCdEf0123456789xyzXYZ", "world.lr: Input should be a valid number"),
        (("world", "lr"), "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "world.lr: Input should be a valid number"),
    ],
    ids=["bool_as_lr", "inf", "nan", "bools_as_seeds", "openai_key_in_lr", "hub_token_in_lr"],
)
def test_params_mean_what_they_say_and_never_echo_a_key(where, value, says):
    """Lax validation read `lr: true` as 1.0, `seeds: [true, false]` as [1, 0] and took `.inf`; and a
    key pasted into a number field was printed back in the message."""

    def update(data):
        _section(data, where[0])[where[1]] = value

    message = params_error(update)
    assert says in message, message
    if isinstance(value, str):
        assert value not in message and value[:8] not in message and "<hidden: looks like a key>" in message


def test_a_whole_number_still_reads_as_a_float_where_a_float_is_meant():
    data = base_params()
    _section(data, "world")["lr"] = 1
    assert parse_params(data).world.lr == 1.0


def test_dvc_set_param_changes_the_one_line_it_sets(tmp_path):
    """`dvc exp run -S detectors.max.dim=128` rewrites params.yaml through DVC's own serializer
    (dvc/utils/hydra.py `apply_overrides`: every list replaced by a plain one, nulls written empty),
    which turned the former layout (flow lists, `null`) into a 104-line diff (issue 52). params.yaml is
    written in the layout that serializer writes, so the experiment's params differ in that line only."""
    import difflib
    import shutil

    from dvc.utils.hydra import apply_overrides

    path = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", path)
    before = path.read_text().splitlines()
    apply_overrides(str(path), ["detectors.max.dim=128"])
    changed = [d for d in difflib.unified_diff(before, path.read_text().splitlines(), n=0) if d[:1] in "+-"]
    assert changed[2:] == ["-    dim: 256", "+    dim: 128"], changed
    apply_overrides(str(path), ["grid.layers=[0,2]", "detectors.max.dim=256"])  # a list: its items, no more
    changed = [d for d in difflib.unified_diff(before, path.read_text().splitlines(), n=0) if d[:1] in "+-"]
    assert sorted(changed[2:]) == ["-  - 1", "-  - 3", "-  - 4"], changed


def _leaves(data: dict, prefix: tuple = ()):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


@pytest.mark.hostile
def test_dvc_set_param_of_any_list_to_empty_keeps_params_yaml_valid_and_its_comments(tmp_path):
    """DVC's serializer (ruamel's round trip) moves a list key's end-of-line comment when the list
    becomes `[]`, and the newline it carried with it: `dvc exp run -S 'grid.transfer=[]'` (a command
    of docs/demo-world.md) wrote `world: path: data/world/model`, a file no YAML parser reads, and
    `world.exposures=[]`, `train.seeds=[]` likewise. Every list of params.yaml set to [] (the flow
    list; a list of items is a block list, which keeps its newlines) and every null to a value: the
    file still parses, holds exactly that change, and keeps every comment outside the value it
    replaced. (Scalars are not tried: DVC writes one in place, as the test above holds.)"""
    import shutil

    from dvc.utils.hydra import apply_overrides

    from halludetect.core import yaml12

    text = (ROOT / "params.yaml").read_text()
    comments = {line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line}
    path = tmp_path / "params.yaml"
    tried = 0
    for keys, value in _leaves(yaml12.load(text)):
        dotted = ".".join(keys)
        if not isinstance(value, list) and value is not None:
            continue
        for given, expected in [("[]", [])] if isinstance(value, list) else [("1", 1)]:
            shutil.copy(ROOT / "params.yaml", path)
            apply_overrides(str(path), [f"{dotted}={given}"])
            after = path.read_text()
            try:
                got = yaml12.load(after)
            except yaml12.YAMLError as e:
                pytest.fail(f"-S {dotted}={given} left params.yaml unreadable: {e}")
            want = yaml12.load(text)
            section = want
            for key in keys[:-1]:
                section = section[key]
            section[keys[-1]] = expected
            assert got == want, f"-S {dotted}={given} changed more than {dotted}"
            kept = {line.split("#", 1)[1].strip() for line in after.splitlines() if "#" in line}
            assert comments <= kept, f"-S {dotted}={given} dropped comments: {sorted(comments - kept)[:3]}"
            tried += 1
    assert tried > 25  # every list and null of the file, not a handful

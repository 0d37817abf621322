"""DVC's recompute contract, checked against the code: every stage lists exactly the modules it
runs (halludetect/core/code_deps.py computes them; `make deps` writes them) and declares the
params it reads, and params.yaml is the one source of defaults.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from halludetect import config
from halludetect.core import code_deps

ROOT = Path(__file__).resolve().parents[1]


def stages() -> dict[str, dict]:
    return {k: code_deps.stage_body(v) for k, v in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items()}


def stage_module(stage: dict) -> str:
    match = re.match(r"\s*python -m (stages\.\w+)", stage["cmd"])
    assert match, f"stage command does not run a stages module: {stage['cmd']!r}"
    return match.group(1)


def module_file(name: str) -> Path:
    path = code_deps.module_file(name)
    assert path is not None, f"no module {name}"
    return path


@pytest.mark.parametrize("name", sorted(stages()))
def test_every_stage_lists_its_code_digest_and_no_code_file(name):
    """The code stage depends on the code folders; every other stage on the one digest file of its
    module (of its method, where its matrix has one and it runs methods/), never on code files."""
    problems = code_deps.stage_problems((ROOT / "dvc.yaml").read_text())
    assert name not in problems, f"{name}: {problems.get(name)}"


def test_dvc_yaml_is_what_make_deps_writes():
    text = (ROOT / "dvc.yaml").read_text()
    assert code_deps.render(text) == text, "the code stage's deps are stale: run `make deps`"
    assert code_deps.stale_stages(text) == []


def test_each_digest_holds_exactly_the_files_its_stage_runs():
    """A digest file lists the sha256 of every file of its closure (of its method's), so a stage
    re-runs when, and only when, a file it runs changes."""
    found = code_deps.digests()
    for module in code_deps.stage_module_names():
        short = module.split(".", 1)[1]
        listed = [line.split("  ", 1)[1] for line in found[f"{short}.txt"].splitlines()]
        assert listed == [code_deps.relative(p) for p in code_deps.closure(module)]
    train_max = found["train/max.txt"]
    assert "halludetect/methods/pooling.py" in train_max and "halludetect/detectors/networks.py" in train_max


def test_one_methods_digest_leaves_out_the_other_methods_files():
    """methods/ imports every method's file, but a method's results depend on its own: an edit to
    methods/sep.py changes SEP's digests and no other method's."""
    runs = {
        m: {code_deps.relative(p) for p in code_deps.closure("stages.train", method=m)} for m in code_deps.all_methods()
    }
    assert "halludetect/methods/sep.py" in runs["sep_tbg"] and "halludetect/methods/sep.py" in runs["sep_slt"]
    assert "halludetect/methods/sep.py" not in runs["max"] | runs["hami"] | runs["eigenscore"]
    assert "halludetect/methods/hami.py" in runs["hami"] and "halludetect/methods/hami.py" in runs["hami_sp"]
    assert "halludetect/methods/pooling.py" not in runs["hami"]
    shared = set.intersection(*runs.values())
    assert {
        "halludetect/methods/__init__.py",
        "halludetect/methods/spec.py",
        "halludetect/detectors/networks.py",
    } <= shared
    every = {code_deps.relative(p) for p in code_deps.closure("stages.train")}
    # the union of the methods' closures is the module's, but for the file that declares the scores
    # with nothing to train: methods/ imports it too, and no method's results depend on it
    scores = {"halludetect/methods/scores.py"}
    assert not scores & set.union(*runs.values()) and set.union(*runs.values()) | scores == every


def test_a_scores_train_and_evaluate_digests_are_its_own_code_and_no_trained_methods():
    """The train and evaluate stages hand a score over to stages/<family>_score.py by name (HAND_OVER):
    its digest is the stage's file, that module's code and its compute's, none of the training's; a
    trained method's holds none of the scores' code; p(True)'s model code is p(True)'s alone, and the
    bundle's export is no score's train code."""
    from halludetect.methods import METHODS, SCORES

    method_files = {
        f"halludetect/{m.replace('.', '/').split('/', 1)[1]}.py" for m in code_deps.builtin_methods().values()
    }
    assert set(code_deps.builtin_scores()) == set(SCORES)
    for module in code_deps.HAND_OVER:
        for name in SCORES:
            files = {code_deps.relative(p) for p in code_deps.closure(module, method=name)}
            handed = code_deps.HAND_OVER[module].replace(".", "/") + ".py"
            assert {handed, module.replace(".", "/") + ".py", "halludetect/methods/scores.py"} <= files, (module, name)
            assert not files & method_files, (module, name)
            assert "halludetect/detectors/training.py" not in files and "halludetect/detectors/fitting.py" not in files
            assert ("halludetect/evaluation/p_true.py" in files) == (name == "p_true"), (module, name)
            assert ("halludetect/lm/hf_models.py" in files) == (name == "p_true"), (module, name)
            if module == "stages.train":
                assert "halludetect/scoring/score_bundle.py" not in files and "stages/evaluate_score.py" not in files
        for name in METHODS:
            files = {code_deps.relative(p) for p in code_deps.closure(module, method=name)}
            assert not files & {"stages/train_score.py", "stages/evaluate_score.py", "halludetect/evaluation/p_true.py"}
    with pytest.raises(ValueError, match="runs no score"):
        code_deps.closure("stages.figures", method="p_sem")


def test_every_declared_compute_and_fitter_is_code_of_the_stage_that_runs_it():
    """A score's `compute` and a kind of fit's `fitter` are "module:function" strings, resolved when
    they run: their modules must be in the code of the stage that runs them, or an edit to one would
    leave the stage's results stale."""
    from halludetect.methods import METHODS, SCORES

    def module_file(target: str) -> str:
        return target.partition(":")[0].replace(".", "/") + ".py"

    for name, s in SCORES.items():
        assert module_file(s.compute) in {code_deps.relative(p) for p in code_deps.closure("stages.train", method=name)}
    for name, m in METHODS.items():
        if m.fit.fitter is not None:
            run = {code_deps.relative(p) for p in code_deps.closure("stages.train", method=name)}
            assert module_file(m.fit.fitter) in run, name


def test_the_code_stage_writes_every_digest_a_stage_lists(tmp_path):
    """Every digest path dvc.yaml names (for every method a matrix can take) is one the code stage writes."""
    written = set(code_deps.write_digests(tmp_path / "code"))
    assert written == {p.relative_to(tmp_path / "code").as_posix() for p in (tmp_path / "code").rglob("*.txt")}
    stages_ = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    out = code_deps.code_out(stages_)
    for name, stage in stages_.items():
        for dep in code_deps.stage_body(stage).get("deps", []):
            if str(dep).startswith(out + "/"):
                rel = str(dep)[len(out) + 1 :]
                names = [
                    *code_deps.all_methods(),
                    *(code_deps.builtin_scores() if name in ("train", "evaluate") else ()),
                ]
                wanted = [rel.replace("${item.method}", m) for m in names] if "${item" in rel else [rel]
                assert set(wanted) <= written, f"{name}: {sorted(set(wanted) - written)} are not written"


def test_the_closure_sees_function_level_imports_package_inits_and_discovery():
    # `world_check` reaches generation through halludetect.world.check (a function-level import
    # among them); every stage runs stages/__init__.py; methods/ imports its modules by discovery.
    runs = {code_deps.relative(p) for p in code_deps.closure("stages.world_check")}
    assert {
        "halludetect/lm/generation.py",
        "halludetect/lm/model_inputs.py",
        "halludetect/world/check.py",
        "stages/__init__.py",
    } <= runs
    assert "halludetect/world/tiny_llama.py" not in runs  # the check never trains
    assert "halludetect/__init__.py" not in runs  # the front door runs nothing
    assert "halludetect/lm/__init__.py" not in runs  # a docstring changes no result
    assert "halludetect/detectors/networks.py" not in runs  # only stages that build detectors run networks
    # config.py validates every method's params section (VALIDATION_ONLY): not code of the check
    assert not any(r.startswith("halludetect/methods/") for r in runs)
    train = {code_deps.relative(p) for p in code_deps.closure("stages.train")}
    assert {
        "halludetect/methods/__init__.py",
        "halludetect/methods/hami.py",
        "halludetect/methods/probe.py",
        "halludetect/methods/spec.py",
        "halludetect/detectors/networks.py",
    } <= train


@pytest.mark.parametrize("name", sorted(stages()))
def test_a_stage_that_reads_detector_params_runs_the_methods(name):
    """config.py's import of methods/ is left out of the closure because it only validates; a
    stage whose outputs depend on a method's params must then reach methods/ through its own
    imports, or an edit to a method's defaults would leave its outputs current."""
    if name == code_deps.CODE_STAGE:
        return  # it reads detectors.<name>.factory only, to find the plugins whose files it digests
    stage = stages()[name]
    reads = [p for p in declared(stage) if p.split(".")[0] == "detectors"]
    runs = {code_deps.relative(p) for p in code_deps.closure(stage_module(stage))}
    if reads:
        assert "halludetect/methods/__init__.py" in runs, f"{name} declares {reads} but never imports methods/"


def test_a_new_import_or_method_file_changes_the_closure(tmp_path, monkeypatch):
    """The closure is read from the source as it is now: a function-level import added to a
    module, or a file dropped into methods/, joins the closure of every stage that runs it."""
    pkg = tmp_path / "halludetect"
    (pkg / "methods").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""front door"""\n')
    (pkg / "a.py").write_text("def f():\n    from halludetect import b\n")
    (pkg / "b.py").write_text("X = 1\n")
    (pkg / "methods" / "__init__.py").write_text("import pkgutil\nfor m in pkgutil.iter_modules(__path__):\n    pass\n")
    (pkg / "methods" / "one.py").write_text("Y = 2\n")
    (pkg / "c.py").write_text("import halludetect.methods\n")
    monkeypatch.setattr(code_deps, "ROOT", tmp_path)
    monkeypatch.setattr(code_deps, "FRONT_DOOR", pkg / "__init__.py")
    code_deps.explicit_imports.cache_clear()
    code_deps._runs_nothing.cache_clear()
    try:
        assert [p.name for p in code_deps.closure("halludetect.a")] == ["a.py", "b.py"]
        assert {p.name for p in code_deps.closure("halludetect.c")} == {"c.py", "__init__.py", "one.py"}
        (pkg / "methods" / "two.py").write_text("Z = 3\n")
        code_deps.explicit_imports.cache_clear()
        assert {p.name for p in code_deps.closure("halludetect.c")} == {"c.py", "__init__.py", "one.py", "two.py"}
    finally:
        code_deps.explicit_imports.cache_clear()
        code_deps._runs_nothing.cache_clear()


def test_front_door_runs_nothing_at_import():
    tree = ast.parse(code_deps.FRONT_DOOR.read_text())
    for node in tree.body:  # module level: only the lazy table, the hook and docstrings
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            assert all(n in ("__future__", "importlib") for n in names), f"front door imports {names}"


# ------------------------------------------------------------------------------ params
def params_read(module_path: Path) -> set[str]:
    """Dotted params keys a stage module reads: `params.a.b...` chains, and the preset lookups."""
    keys = set()
    for node in ast.walk(ast.parse(module_path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "params"
        ):
            keys.add({"model": "models.*", "dataset": "datasets.*"}.get(node.func.attr, node.func.attr))
        elif isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "params" and chain[-1] not in ("model", "dataset"):
                keys.add(".".join(reversed(chain)))
    # Only the longest chains: `params.train.seeds` also yields `params.train`.
    return {k for k in keys if not any(o != k and o.startswith(k + ".") for o in keys)}


def listed_params(stage: dict) -> list:
    """The params keys a stage names: its `meta.params` (runner/params_digests.py), or DVC `params:`
    for the code and params stages."""
    return (stage.get("meta") or {}).get("params") or stage.get("params") or []


def declared(stage: dict) -> list[str]:
    out = []
    for p in listed_params(stage):
        out += list(p) if isinstance(p, dict) else [p]
    return [re.sub(r"\$\{item\.\w+\}", "*", p) for p in out]


def covers(decl: str, key: str) -> bool:
    """A declared key covers what it is a prefix of, and a read section it is part of
    (`detectors.*` covers `params.detectors` passed on to pick the method's section)."""
    a, b = decl.split("."), key.split(".")
    n = min(len(a), len(b))
    return all(x == y or "*" in (x, y) for x, y in zip(a[:n], b[:n]))


@pytest.mark.parametrize("name", sorted(stages()))
def test_every_stage_declares_the_params_it_reads(name):
    stage = stages()[name]
    path = module_file(stage_module(stage))
    undeclared = sorted(k for k in params_read(path) if not any(covers(d, k) for d in declared(stage)))
    assert not undeclared, f"{name} reads params {undeclared} that dvc.yaml does not declare"


def generate_keys() -> set[str]:
    """Every dotted key of the generate section (generate.endpoint.model, ...)."""
    return {f"generate.{k}" for k in flatten(config.GenerateParams().model_dump(mode="json"))}


TRANSPORT = {f"generate.endpoint.{k}" for k in config.CompletionsParams.TRANSPORT}


def test_generate_declares_every_key_that_changes_a_sample_and_no_transport_key():
    """`generate` lists its keys one by one (so that the endpoint's transport, how requests reach the
    engine, re-runs nothing): a key added to GenerateParams must be added there too, or changing
    it would leave stale generations; `latency` samples with hf, so it lists the sampling keys."""
    declared = {name: set(declared_of(stages()[name])) for name in ("generate", "latency")}
    missing = sorted(generate_keys() - TRANSPORT - declared["generate"])
    assert not missing, f"generate: dvc.yaml does not declare {missing}; add them to its params"
    assert not declared["generate"] & TRANSPORT, "the endpoint's transport must not re-run generate"
    sampling = {k for k in generate_keys() if not k.startswith(("generate.endpoint.", "generate.backend"))}
    assert sorted(sampling - declared["latency"]) == [], "latency samples with every sampling key"
    assert not {k for k in declared["latency"] if k.startswith(("generate.endpoint", "generate.backend"))}


def declared_of(stage: dict) -> list[str]:
    return [p for p in listed_params(stage) if isinstance(p, str)]


OWN_PARAMS = {"code": ["detectors"], "params": [{"params.yaml": None}]}  # the two stages DVC reads params for


def test_only_the_code_and_params_stages_list_dvc_params():
    """Every other stage names its keys in `meta.params` and depends on its params file, so DVC parses
    params.yaml once per `dvc status`, not once per stage (runner/params_digests.py); the params stage
    tracks the whole file, so every key reaches `dvc params diff` and `dvc exp show`."""
    dvc_params = {name: s["params"] for name, s in stages().items() if "params" in s}
    assert dvc_params == OWN_PARAMS, dvc_params
    unnamed = sorted(n for n, s in stages().items() if n not in OWN_PARAMS and "params" not in (s.get("meta") or {}))
    assert not unnamed, f"{unnamed}: name the params each reads in meta.params (an empty list if none)"


def test_every_stage_gets_its_params_file_from_one_parse_of_params_yaml():
    """DVC's own expansion of dvc.yaml (each matrix item's keys resolved): every stage but the code and
    params stages depends on exactly `data/params/<its name>.json`, and params.yaml has every key."""
    from halludetect.runner import params_digests
    from halludetect.runner.dvc_internals import Repo

    with Repo(str(ROOT)) as repo:
        resolved = list(repo.index.stages)
    texts = params_digests.texts(resolved, ROOT)
    names = {params_digests.stage_name(s, ROOT) for s in resolved}
    assert {f"{n}.json" for n in names - set(OWN_PARAMS)} == set(texts)
    assert '"detectors.hami"' in texts["train@world-world-hami.json"]
    assert '"detectors.max"' not in texts["train@world-world-hami.json"]


STAGE_SECTIONS = [
    "world",
    "prepare",
    "generate",
    "dump",
    "judge",
    "cluster",
    "detectors",
    "train",
    "evaluate",
    "export",
    "transfer",
    "lookalike",
    "misinformed",
    "latency",
    "analyze",
    "report",
]


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("section", STAGE_SECTIONS)
def test_params_yaml_is_the_one_source_of_defaults(section):
    """Every key of a stage's section is written in params.yaml, and the code's default is the
    same value: a library user calling `GenerateParams()` gets what `dvc repro` runs."""
    written = yaml.safe_load((ROOT / "params.yaml").read_text())[section]
    model = config.Params.model_fields[section].annotation
    defaults = flatten(model().model_dump(mode="json"))
    assert sorted(flatten(written)) == sorted(defaults), f"params.yaml {section}: keys differ from the code's"
    validated = flatten(model.model_validate(written).model_dump(mode="json"))
    differ = {k: (validated[k], defaults[k]) for k in defaults if validated[k] != defaults[k]}
    assert not differ, f"params.yaml {section} (value, code default) differ: {differ}"


@pytest.mark.parametrize("stage", ["report", "prepare", "train_score", "judge", "cluster", "figures", "code"])
def test_stages_without_a_model_do_not_load_torch(stage):
    """A stage imports only what it runs: the report and the label stages start in a fraction
    of a second instead of loading torch to catch exception classes."""
    import subprocess
    import sys

    code = f"import sys, stages.{stage}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

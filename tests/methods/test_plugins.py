"""Detectors registered from the user's own package (halludetect/methods/plugins.py): the example
of docs/detectors.md "Your own detector" runs as written from a small package that this test
builds in a temporary folder (a module plus a dist-info with its entry_points.txt on the Python
path, no pip), and every bad plugin is one line naming the entry point or the params key and the
fix. Each case runs in a subprocess: entry points are read once per process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from support import doc_blocks
from torch import nn

from halludetect.core import code_deps

ROOT = code_deps.ROOT
DOC = doc_blocks("docs/detectors.md", "Your own detector")


def package(site: Path, module: str, entry_points: dict[str, str] | None) -> Path:
    """my_detectors/wide.py holding `module`, and (with `entry_points`) the dist-info of an
    installed distribution my-detectors 0.1 declaring them in the group halludetect.detectors."""
    (site / "my_detectors").mkdir(parents=True, exist_ok=True)
    (site / "my_detectors" / "__init__.py").write_text("")
    (site / "my_detectors" / "wide.py").write_text(module)
    if entry_points is not None:
        dist = site / "my_detectors-0.1.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-detectors\nVersion: 0.1\n")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (dist / "entry_points.txt").write_text(f"[halludetect.detectors]\n{lines}")
    return site


def run(code: str, site: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def doc_entry_points() -> dict[str, str]:
    return tomllib.loads(DOC["toml"][0])["project"]["entry-points"]["halludetect.detectors"]


CHECK = """
import json, yaml, torch
from halludetect.config import parse_params
from halludetect.activations.bags import Bags
from halludetect.detectors.build import build_detector
from halludetect.methods import METHODS
from halludetect.report.cells import NAMES, family

data = yaml.safe_load(open("params.yaml"))
doc = yaml.safe_load(DOC_YAML)
data["grid"]["detectors"] = doc["grid"]["detectors"]
data["detectors"].update(doc["detectors"])
params = parse_params(data)
m = METHODS["wide_max"]
z = build_detector("wide_max", 3, params.detectors.wide_max)(Bags(torch.randn(5, 3), torch.tensor([2, 3])))
print(json.dumps({"dim": params.detectors.wide_max.dim, "family": family("wide_max"), "name": NAMES["wide_max"],
                  "origin": [m.origin.via, m.origin.factory, m.origin.distribution], "shape": list(z.shape),
                  "grid": params.grid.detectors}))
"""


def test_the_docs_plugin_registers_from_its_entry_point_as_written(tmp_path):
    site = package(tmp_path, DOC["python"][0], doc_entry_points())
    out = run(CHECK.replace("DOC_YAML", repr(DOC["yaml"][0])), site)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got == {
        "dim": 512,
        "family": "yours",
        "name": "Wide max pooling",
        "origin": ["entry point", "my_detectors.wide:make", "my-detectors 0.1"],
        "shape": [2],
        "grid": ["hami", "hami_sp", "max", "wide_max"],
    }


def test_the_params_key_registers_the_same_factory_without_packaging(tmp_path):
    site = package(tmp_path, DOC["python"][0], None)
    code = CHECK.replace("DOC_YAML", repr(DOC["yaml"][0])).replace(
        'data["detectors"].update(doc["detectors"])',
        'data["detectors"].update(doc["detectors"])\n'
        'data["detectors"]["wide_max"]["factory"] = "my_detectors.wide:make"',
    )
    out = run(code, site)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["origin"] == ["params", "my_detectors.wide:make", None] and got["dim"] == 512


PARSE = """
import yaml
from halludetect.config import parse_params
data = yaml.safe_load(open("params.yaml"))
data["detectors"].update(SECTIONS)
data["grid"]["detectors"] += GRID
try:
    parse_params(data, "params.yaml")
    print("accepted")
except Exception as e:
    print(type(e).__name__, str(e))
"""


def parse(site: Path, sections: dict, grid: list[str]) -> str:
    out = run(PARSE.replace("SECTIONS", repr(sections)).replace("GRID", repr(grid)), site)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


GOOD = DOC["python"][0]


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("module", "value", "message"),
    [
        (GOOD, "no_such_pkg.wide:make", "no module 'no_such_pkg.wide' on the Python path"),
        (
            "raise RuntimeError('boom')\n",
            "my_detectors.wide:make",
            "importing 'my_detectors.wide' failed: RuntimeError: boom",
        ),
        (GOOD, "my_detectors.wide:nothing", "'my_detectors.wide' has no 'nothing'"),
        (
            GOOD + "\nNOT_CALLABLE = 3\n",
            "my_detectors.wide:NOT_CALLABLE",
            "is a int, not a callable that returns a Method",
        ),
        (
            GOOD + "\ndef bad():\n    return {'name': 'wide_max'}\n",
            "my_detectors.wide:bad",
            "returned a dict, not a halludetect.methods.spec.Method",
        ),
        (
            GOOD + "\ndef boom():\n    raise ValueError('no')\n",
            "my_detectors.wide:boom",
            "'my_detectors.wide:boom()' raised ValueError: no",
        ),
        (GOOD, "my_detectors.wide", "is not 'module:factory'"),
        # a factory written for Method's former flags: the error says how to write it now
        (
            GOOD + "\ndef old():\n    m = make()\n"
            "    return type(m)(m.name, m.display, m.params, m.build, min_tokens=2)\n",
            "my_detectors.wide:old",
            "unexpected keyword argument 'min_tokens'; write reads=Reads(min_tokens=N)",
        ),
        (
            GOOD + "\nfrom halludetect.methods.spec import Fit\ndef odd():\n    return Fit('none', 'label')\n",
            "my_detectors.wide:odd",
            "raised ValueError: Fit('none', 'label', None): the shared loop (sgd) has no fitter, every other kind one; "
            "an unsupervised kind (none) has no target, every other kind one",
        ),
        (
            GOOD + "\nfrom dataclasses import replace\ndef old():\n    return replace(make(), fit='sgd')\n",
            "my_detectors.wide:old",
            "its Method's fit is 'sgd', not a kind of fit: write fit=SGD (the shared loop)",
        ),
    ],
)
def test_a_bad_entry_point_is_one_line_naming_it_and_the_fix(tmp_path, module, value, message):
    site = package(tmp_path, module, {"wide_max": value})
    got = parse(site, {}, [])
    assert (
        got.startswith("PluginError entry point 'wide_max = ")
        and "(group halludetect.detectors, my-detectors 0.1)" in got
    )
    assert message in got and "pip uninstall my-detectors" in got and "\n" not in got


@pytest.mark.hostile
def test_a_bad_params_key_plugin_names_the_key():
    got = parse(ROOT, {"wide_max": {"factory": "no_such_pkg.wide:make", "dim": 4}}, ["wide_max"])
    assert got.startswith("ParamsError params.yaml: 1 problem(s)")
    assert "detectors.wide_max.factory: no module 'no_such_pkg.wide' on the Python path" in got


@pytest.mark.hostile
def test_a_plugin_named_like_a_built_in_or_under_another_name_is_refused(tmp_path):
    site = package(tmp_path, GOOD, None)
    got = parse(site, {"max": {"factory": "my_detectors.wide:make"}}, [])
    assert "detectors.max.factory: the factory returned the method 'wide_max', registered as 'max'" in got
    renamed = GOOD.replace('"wide_max",\n        "Wide', '"max",\n        "Wide')
    site = package(tmp_path / "b", renamed, None)
    got = parse(site, {"max": {"factory": "my_detectors.wide:make"}}, [])
    assert "detectors.max.factory: 'max' is already a built-in method; give the plugin's method another name" in got
    as_score = GOOD.replace('"wide_max",\n        "Wide', '"length",\n        "Wide')
    site = package(tmp_path / "c", as_score, None)
    got = parse(site, {"length": {"factory": "my_detectors.wide:make"}}, [])
    assert (
        "detectors.length.factory: 'length' is already a score with nothing to train (halludetect/methods/scores.py); "
        "give the plugin's method another name"
    ) in got


@pytest.mark.hostile
def test_invalid_plugin_params_name_the_key_and_suggest(tmp_path):
    site = package(tmp_path, GOOD, doc_entry_points())
    got = parse(site, {"wide_max": {"dim": 4, "dimm": 5}}, ["wide_max"])
    assert "detectors.wide_max.dimm: unknown key; did you mean 'dim'?" in got


@pytest.mark.hostile
def test_a_build_that_returns_no_module_is_refused_naming_the_plugin(tmp_path):
    module = GOOD.replace(
        'build=lambda net, d, p: net.PoolingNet(d, p.dim, p.dropout, "max")', "build=lambda net, d, p: 42"
    )
    site = package(tmp_path, module, doc_entry_points())
    code = """
from halludetect.detectors.build import build_detector, params_for
try:
    build_detector("wide_max", 4, params_for("wide_max"))
except Exception as e:
    print(type(e).__name__, e)
"""
    out = run(code, site)
    assert out.stdout.strip() == (
        "PluginError detector 'wide_max' (from the entry point 'my_detectors.wide:make' (group "
        "halludetect.detectors, my-detectors 0.1)): build returned a int, not a torch.nn.Module mapping "
        "Bags to one score per answer; fix its build"
    ), out.stderr[-2000:]


def test_a_plugin_in_the_repository_is_code_of_the_stages_that_run_methods_only(tmp_path):
    """make deps lists an in-repository plugin's folder (params key) among the code stage's deps; its
    file is in the plugin's own digests and in those of the stages that read every method, never in
    generate's or another method's; --write then --check agree; an edit to the plugin changes the
    score fingerprint."""
    for part in ("halludetect", "stages"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / f, tmp_path / f)
    package(tmp_path, GOOD, None)
    params = (
        (tmp_path / "params.yaml")
        .read_text()
        .replace(
            "  probe:                   # logistic",
            "  wide_max:\n    factory: my_detectors.wide:make\n  probe:                   # logistic",
        )
    )
    (tmp_path / "params.yaml").write_text(params)
    code = """
import json
from halludetect.core import code_deps
stages = ("stages.train", "stages.generate", "stages.report")
out = {m: [code_deps.relative(p) for p in code_deps.closure(m)] for m in stages}
digests = code_deps.digests()
out["train/wide_max"] = digests["train/wide_max.txt"]
out["train/max"] = digests["train/max.txt"]
out["digest"] = "my_detectors/wide.py" in code_deps.code_digest("halludetect.scoring.scorer")
print(json.dumps(out))
"""
    out = run(code, tmp_path, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert "my_detectors/wide.py" in got["stages.train"] and "my_detectors/wide.py" in got["stages.report"]
    assert "my_detectors/wide.py" not in got["stages.generate"] and got["digest"]
    assert "my_detectors/wide.py" in got["train/wide_max"] and "my_detectors/wide.py" not in got["train/max"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    tool = [sys.executable, "-m", "halludetect.core.code_deps"]
    stale = subprocess.run([*tool, "--check"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert stale.returncode == 1 and "stage 'code'" in stale.stderr and "my_detectors" in stale.stderr
    subprocess.run([*tool, "--write"], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert subprocess.run([*tool, "--check"], cwd=tmp_path, env=env, capture_output=True).returncode == 0
    subprocess.run([*tool, "--write"], cwd=tmp_path, env=env, check=True, capture_output=True)  # idempotent
    dvc_yaml = (tmp_path / "dvc.yaml").read_text()
    assert dvc_yaml.count("      - my_detectors\n") == 1  # the code stage's deps only
    assert "my_detectors/" not in dvc_yaml


# ------------------------------------------------------------------ plugins that misbehave at run time
class Misbehaves(nn.Module):
    """A plugin's network: a linear score on each bag's last state (shape [B]), then what `bad` makes
    of it: NaN or infinite scores (in training, or in eval mode only), a column [B, 1], a tuple."""

    def __init__(self, d: int, bad: str):
        super().__init__()
        self.linear = nn.Linear(d, 1)
        self.bad = bad

    def forward(self, bags):
        z = self.linear(bags.tokens[bags.token_rows(-1)]).squeeze(-1)  # [B]
        if self.bad == "nan" or (self.bad == "nan_in_eval" and not self.training):
            return z * float("nan")
        if self.bad == "inf":
            return z.detach() * 0 + float("inf")
        return {"column": lambda: z.unsqueeze(-1), "tuple": lambda: (z,)}.get(self.bad, lambda: z)()


@pytest.fixture
def misbehaving():
    """Register `Misbehaves` as a params-key plugin named after its fault; unregistered after the test."""
    from halludetect.methods import METHODS, Method, Origin, register
    from halludetect.methods.pooling import PoolingParams

    names = []

    def make(bad: str) -> str:
        name = f"plugin_{bad}"
        origin = Origin(f"my_detectors.bad:{name}", "params")
        build = lambda net, d, p: Misbehaves(d, bad)  # noqa: E731
        register(Method(name, name, PoolingParams, build=build, family="yours", origin=origin))
        names.append(name)
        return name

    yield make
    for name in names:
        METHODS.pop(name)


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("bad", "returned"),
    [
        ("nan", "on the first training batch of 32 bags its network returned 32 NaN and 0 infinite score(s) of 32"),
        ("inf", "on the first training batch of 32 bags its network returned 0 NaN and 32 infinite score(s) of 32"),
        ("column", "on the first training batch of 32 bags its network returned a tensor of shape [32, 1]"),
        ("tuple", "on the first training batch of 32 bags its network returned a tuple"),
        ("nan_in_eval", "on the validation split after epoch 1 of 60 bags its network returned 60 NaN"),
    ],
)
def test_a_plugin_returning_nan_or_the_wrong_shape_stops_training_at_once_naming_it(misbehaving, bad, returned):
    """Checked on the first batch (and on each epoch's validation scores, which training computes
    anyway), never after every epoch has run (NaN failed then, writing the figures' JSON) nor inside
    torch (another shape failed with torch's message)."""
    from support import synthetic

    from halludetect.detectors.build import params_for
    from halludetect.detectors.data import split_data
    from halludetect.detectors.training import train_detector
    from halludetect.methods import PluginError

    name = misbehaving(bad)
    layer, labels = synthetic()
    train, val = split_data(layer, labels, "train"), split_data(layer, labels, "val")
    with pytest.raises(PluginError) as e:
        train_detector(name, params_for(name), train, val, epochs=3, batch_size=32, seed=0)
    message = str(e.value)
    assert message.startswith(
        f"detector '{name}' (from the params key detectors.<name>.factory = 'my_detectors.bad:{name}'): "
    )
    assert returned in message and message.endswith("; fix its forward") and "\n" not in message
    fine = misbehaving("fine")  # a plugin that returns one finite score per bag trains as before
    res = train_detector(fine, params_for(fine), train, val, epochs=2, batch_size=32, seed=0)
    assert len(res.curve) == 2 and all(torch.isfinite(v).all() for v in res.state_dict.values())


@pytest.mark.hostile
def test_a_plugin_bundle_of_the_wrong_shape_stops_score_naming_it(misbehaving, bundle_path, tiny_model_dir, tmp_path):
    from halludetect.detectors.build import build_detector, params_for
    from halludetect.methods import PluginError
    from halludetect.scoring.bundle import load_bundle, save_bundle
    from halludetect.scoring.scorer import score_answers

    name = misbehaving("column")
    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta)) | {
        "method": name,
        "params": params_for(name).model_dump(),
        "origin": {"factory": f"my_detectors.bad:{name}", "via": "params", "distribution": None},
    }
    out = tmp_path / "column.safetensors"
    save_bundle(out, {s: build_detector(name, 32, params_for(name)).state_dict() for s in b.seeds}, meta)
    row = {"question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar."}
    with pytest.raises(
        PluginError, match=r"on a batch of answers of 1 bags its network returned a tensor of shape \[1, 1\]"
    ):
        score_answers(out, [row], model=str(tiny_model_dir), device="cpu")


@pytest.mark.hostile
def test_show_summarises_a_params_key_plugins_bundle_without_the_plugin(bundle_path, tmp_path, capsys):
    """`score` needs the plugin registered (it rebuilds the network); `show` reads the metadata only:
    it summarises the bundle, with a warning saying how to register the plugin to score it."""
    from halludetect import cli as console
    from halludetect.scoring.bundle import load_bundle, save_bundle

    b = load_bundle(bundle_path)
    factory = "my_detectors.wide:make"
    meta = json.loads(json.dumps(b.meta)) | {
        "method": "wide_max",
        "origin": {"factory": factory, "via": "params", "distribution": None},
    }
    out = tmp_path / "wide_max.safetensors"
    save_bundle(out, {s: b.detectors[s].state_dict() for s in b.seeds}, meta)
    console.main(["show", str(out)])
    text, err = capsys.readouterr()
    assert "detector     wide_max (a plugin's method, not registered here): the mean logit of 2 seeds" in text
    assert f"from the plugin factory {factory} (params)" in text and "threshold    fpr_0.05 = " in text
    assert err.startswith(f"warning: {out}: its detector 'wide_max' comes from the plugin factory '{factory}'")
    assert "shown from its metadata" in err
    console.main(["show", str(out), "--json"])
    assert json.loads(capsys.readouterr().out)["origin"]["factory"] == factory
    with pytest.raises(SystemExit) as e:  # scoring it still needs the plugin
        console.main(["score", "--bundle", str(out), "--input", "x.jsonl", "--out", str(tmp_path / "o.jsonl")])
    assert e.value.code == 2 and f"load_factory('wide_max', '{factory}') first" in capsys.readouterr().err


def _section_keys(kind, prefix: str, seen: set) -> list[str]:
    """Every dotted key of a params model, through nested sections, optionals, lists and dicts."""
    import typing

    from halludetect.core.sections import Section

    out = []
    if isinstance(kind, type) and issubclass(kind, Section):
        if kind in seen:
            return out
        seen = seen | {kind}
        for key, field in kind.model_fields.items():
            name = field.alias or key
            out.append(f"{prefix}{name}")
            out += _section_keys(field.annotation, f"{prefix}{name}.", seen)
    for arg in typing.get_args(kind):
        out += _section_keys(arg, prefix, seen)
    return out


def test_no_params_key_is_one_dvcs_run_cache_ignores():
    """DVC's run-cache drops keys named size or nfiles from a stage's entry, params included
    (treeverse/dvc#10296): a change to such a param would give a stage its old outputs back. No
    built-in section has one (every method's section is in Params through its detectors section)."""
    from halludetect.config import Params
    from halludetect.methods import METHODS
    from halludetect.methods.plugins import DVC_BLIND_KEYS

    keys = _section_keys(Params, "", set())
    for name, m in METHODS.items():
        keys += _section_keys(m.params, f"detectors.{name}.", set())
    assert len(keys) > 200 and any(k.startswith("detectors.hami.") for k in keys)
    assert [k for k in keys if k.rsplit(".", 1)[-1] in DVC_BLIND_KEYS] == []


@pytest.mark.hostile
def test_a_plugin_with_a_param_dvc_cannot_see_is_refused(tmp_path, monkeypatch):
    from halludetect.methods import METHODS, PluginError
    from halludetect.methods.plugins import load_factory

    (tmp_path / "blind_plugin.py").write_text(
        DOC["python"][0].replace("dim: PositiveInt = 1024", "dim: PositiveInt = 1024\n    size: PositiveInt = 3")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as e:
        load_factory("wide_max", "blind_plugin:make")
    assert "detectors.wide_max.factory: its params section has detectors.wide_max.size" in str(e.value)
    assert "treeverse/dvc#10296" in str(e.value) and "rename the field" in str(e.value)
    assert "wide_max" not in METHODS


def test_a_blind_key_inside_an_optional_a_list_or_a_dict_of_sections_is_found():
    """The plugin check walks what a params section holds, not only its nested sections."""
    from typing import Optional

    from halludetect.core.sections import Section
    from halludetect.methods.plugins import dvc_blind_keys

    class Window(Section):
        size: int = 3

    class Pool(Section):
        nfiles: int = 1

    class Params(Section):
        window: Optional[Window] = None  # noqa: UP045 (the spelling a plugin may use)
        windows: list[Window] = []
        pools: dict[str, Pool] = {}
        either: Window | Pool | None = None
        nested: dict[str, list[Window]] = {}

    assert dvc_blind_keys(Params) == [
        "window.size",
        "windows.size",
        "pools.nfiles",
        "either.size",
        "either.nfiles",
        "nested.size",
    ]

"""core/registry.py: one registry for the parts a params word names (judge and NLI backends,
samplers, dataset loaders), with lazy targets, entry points and did-you-mean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from halludetect.config import DatasetFormat, JudgeParams, ParamsError, load_params, parse_params
from halludetect.core import code_deps, registry
from halludetect.core.lookup import UnknownName
from halludetect.core.yaml12 import load as yaml_load

ROOT = code_deps.ROOT


@pytest.mark.parametrize("kind", sorted(registry.BUILTINS))
def test_every_builtin_resolves(kind):
    """Each built-in target imports (a factory, an opener, a loader) or is a valid format file."""
    for name in registry.names(kind):
        part = registry.resolve(kind, name)
        if registry.targets(kind)[name].endswith(".yaml"):
            fmt = DatasetFormat.model_validate(part or {})
            if fmt.reader:
                assert callable(registry.load_target(fmt.reader, name))
        else:
            assert callable(part), (kind, name)


def test_every_format_file_is_registered():
    """A format file nobody names would be dead data: each file of qa/formats/ is a built-in's target."""
    formats = (registry.PACKAGE_DIR / "qa" / "formats").glob("*")
    files = {p.relative_to(registry.PACKAGE_DIR).as_posix() for p in formats}
    assert files == set(registry.BUILTINS["dataset"].values())


def test_an_unknown_name_gets_did_you_mean_from_the_params():
    data = yaml_load((ROOT / "params.yaml").read_text())
    data["judge"]["backend"] = "mach"
    data["cluster"]["backend"] = "exactt"
    data["datasets"]["world"]["loader"] = "trivia"
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "judge.backend: unknown judge backend (judge.backend) 'mach'; did you mean 'match'?" in msg
    assert "cluster.backend: unknown NLI backend (cluster.backend) 'exactt'; did you mean 'exact'?" in msg
    assert "datasets.world.loader: unknown dataset loader (datasets.<name>.loader) 'trivia'; did you mean" in msg
    assert "'trivia'; did you mean 'trivia_qa'?" in msg
    with pytest.raises(UnknownName, match="valid: completions, hf"):
        registry.resolve("sampler", "vllm")
    with pytest.raises(ValueError, match="no registry kind 'judges'"):
        registry.names("judges")


def test_a_target_that_cannot_load_is_named(monkeypatch):
    monkeypatch.setitem(registry.BUILTINS, "judge", {**registry.BUILTINS["judge"], "gone": "halludetect.nowhere:Judge"})
    with pytest.raises(registry.TargetError, match=r"\(judge.backend\) 'gone': cannot import 'halludetect.nowhere'"):
        registry.resolve("judge", "gone")
    monkeypatch.setitem(registry.BUILTINS["judge"], "gone", "halludetect.labels.judges.match:Nope")
    with pytest.raises(registry.TargetError, match="module 'halludetect.labels.judges.match' has no 'Nope'"):
        registry.resolve("judge", "gone")
    monkeypatch.setitem(registry.BUILTINS["judge"], "gone", "no_colon")
    with pytest.raises(registry.TargetError, match="is not 'module:object'"):
        registry.resolve("judge", "gone")


def test_config_closure_holds_no_backend_and_a_resolving_stage_holds_its_kind():
    """A target is a string so that config (in every stage's closure) holds none of them; the stage
    that resolves a kind holds that kind's targets, as an import would make it."""

    def files(module):
        return {code_deps.relative(p) for p in code_deps.closure(module)}

    config = files("halludetect.config")
    assert not {f for f in config if "judges/" in f or "nli/" in f or "formats/" in f or "samplers" in f}
    judge, prepare, generate = files("stages.judge"), files("stages.prepare"), files("stages.generate")
    assert {"halludetect/labels/judges/match.py", "halludetect/labels/judges/openai.py"} <= judge
    assert "halludetect/qa/formats/squad.yaml" in prepare and "halludetect/qa/datasets.py" in prepare
    assert not {f for f in judge | generate if "formats/" in f}  # they read the questions table, not a loader
    assert "halludetect/lm/samplers.py" in generate


def test_an_entry_point_adds_a_judge_without_editing_the_code(tmp_path):
    """An installed package's entry point (group halludetect.judges) is a name config accepts and the
    judge stage builds; its module is imported only then."""
    site = tmp_path / "site"
    (site / "my_judges").mkdir(parents=True)
    (site / "my_judges" / "__init__.py").write_text(
        "from halludetect.labels.judges.base import Verdict\n"
        "class Always:\n    name = 'always'\n"
        "    def judge(self, items, with_reference):\n        return [Verdict('yes', 'always') for _ in items]\n"
    )
    dist = site / "my_judges-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-judges\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[halludetect.judges]\nalways = my_judges:Always\n")
    code = (
        "import json, sys\n"
        "from halludetect.config import JudgeParams\n"
        "from halludetect.labels.judges import JudgeItem, get_judge\n"
        "p = JudgeParams(backend='always')\n"
        "before = 'my_judges' in sys.modules\n"
        "v = get_judge(p.backend).judge([JudgeItem('q', 'a', ('b',))], True)\n"
        "print(json.dumps([before, v[0].verdict]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [False, "yes"]
    with pytest.raises(ValueError, match="'always'"):
        JudgeParams(backend="always")  # not installed here
    # a plugin may not take a built-in's name: every stage says so, naming the package
    (dist / "entry_points.txt").write_text("[halludetect.judges]\nmatch = my_judges:Always\n")
    code = "from halludetect.config import JudgeParams\nJudgeParams(backend='match')\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "entry point 'match = my_judges:Always' of group halludetect.judges (package my-judges)" in out.stderr
    assert "takes the name of the built-in judge backend (judge.backend) 'match'" in out.stderr


def test_the_shipped_presets_name_registered_loaders():
    p = load_params(ROOT / "params.yaml")
    for name, preset in p.datasets.items():
        assert (preset.loader or "file") in registry.names("dataset"), name
    assert Path(registry.PACKAGE_DIR / "qa" / "formats" / "svamp.yaml").is_file()

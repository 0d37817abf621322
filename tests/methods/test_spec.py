"""The methods' registry (halludetect/methods/): config's detectors params derive from it, a name
registered twice is refused, an unknown name suggests the closest, and the trait lists are the
paper's (HaMI (SP) alone reads P_sem; the HaMI networks are the ones the sensitivity analysis applies to)."""

import pytest

from halludetect.config import DetectorsParams
from halludetect.core.lookup import UnknownName
from halludetect.detectors.build import DETECTORS
from halludetect.methods import ANALYZABLE, CLUSTER_METHODS, METHODS, SP_METHODS, method, register


def test_registry_covers_every_params_section():
    from halludetect.methods import SCORES

    assert set(DETECTORS) | set(SCORES) == set(DetectorsParams.model_fields) and not set(DETECTORS) & set(SCORES)


def test_a_name_registered_twice_is_refused():
    before = dict(METHODS)
    with pytest.raises(ValueError, match="detection method 'max' is registered twice"):
        register(METHODS["max"])
    assert before == METHODS  # unchanged


def test_an_unknown_method_suggests_the_closest_and_lists_every_method():
    with pytest.raises(
        UnknownName,
        match=r"^unknown detector 'gated-attention'; did you mean 'gated_attention'\? "
        r"valid: attention, eigenscore, gated_attention, hami, hami_sp, max, mean, probe, "
        r"raw_max, raw_mean, saplma, sep_slt, sep_tbg$",
    ):
        method("gated-attention")
    assert method("hami_sp").name == "hami_sp"


def test_trait_lists_are_the_papers():
    assert list(SP_METHODS) == ["hami_sp"]
    assert list(CLUSTER_METHODS) == ["hami_sp", "sep_tbg", "sep_slt"]  # SEP trains on the semantic entropy
    assert sorted(ANALYZABLE) == ["hami", "hami_sp"]
    assert len({m.display for m in METHODS.values()}) == len(METHODS)  # the report's row names are distinct


def test_every_kind_of_fit_names_a_fitter_that_resolves_and_the_built_ins_declare_the_papers():
    from halludetect.core.registry import load_target
    from halludetect.methods import LOGISTIC_REGRESSION, SE_PROBE, SGD, UNSUPERVISED

    assert SGD.loop and SGD.fitter is None
    for kind in (LOGISTIC_REGRESSION, SE_PROBE, UNSUPERVISED):
        assert not kind.loop and callable(load_target(kind.fitter, kind.name))
    kinds = {n: m.fit for n, m in METHODS.items()}
    assert kinds["sep_tbg"] == kinds["sep_slt"] == SE_PROBE and kinds["eigenscore"] == UNSUPERVISED
    assert {n for n, k in kinds.items() if k == SGD} == set(METHODS) - {"sep_tbg", "sep_slt", "eigenscore"}
    assert [n for n, m in METHODS.items() if m.reads.question] == ["eigenscore"]
    assert METHODS["sep_tbg"].reads.positions == ("predicting",) and METHODS["sep_slt"].reads.min_tokens == 2
    # what a response costs each, the report's marks, follows from the two declarations
    assert METHODS["eigenscore"].needs == ("sampling", "hidden states")
    assert METHODS["sep_slt"].needs == ("SE labels (sampling + NLI) to train", "hidden states")
    assert METHODS["hami_sp"].needs == ("labels", "sampling + NLI", "hidden states")


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reads": "p_sem"}, "reads is a spec.Reads and fit one of spec's Fit kinds"),
        ({"fit": "sgd"}, "reads is a spec.Reads and fit one of spec's Fit kinds"),
        ({"reads_min_tokens": 0}, "reads.min_tokens >= 1"),
    ],
)
def test_a_declaration_of_the_wrong_type_is_refused_at_registration(change, message):
    from dataclasses import replace

    from halludetect.methods import Reads

    if "reads_min_tokens" in change:
        change = {"reads": Reads(min_tokens=change["reads_min_tokens"])}
    bad = replace(METHODS["max"], name="bad_max", **change)
    with pytest.raises(ValueError, match=message):
        register(bad)
    assert "bad_max" not in METHODS


def test_the_scores_with_nothing_to_train_are_declared_once_with_their_params_section():
    from halludetect.core.registry import load_target
    from halludetect.methods import SCORES
    from halludetect.report.cells import NAMES, family

    assert list(SCORES) == [
        "p_sem", "semantic_entropy", "logprob", "length", "lexical_similarity", "semantic_sets", "p_true"
    ]  # fmt: skip
    assert [n for n, s in SCORES.items() if s.source == "model"] == ["p_true"]
    for name, s in SCORES.items():
        assert DetectorsParams.model_fields[name].annotation is s.params
        assert callable(load_target(s.compute, name)) and NAMES[name] == s.display and family(name) == s.family
    assert not set(SCORES) & set(METHODS)


@pytest.mark.hostile
def test_a_score_named_like_a_method_or_another_score_is_refused():
    from halludetect.methods import SCORES, register_scores

    with pytest.raises(ValueError, match="score 'p_sem' is registered twice"):
        register_scores(replace_name(SCORES["length"], "p_sem"))
    with pytest.raises(ValueError, match="score 'max': already the name of a detection method"):
        register_scores(replace_name(SCORES["length"], "max"))
    with pytest.raises(ValueError, match=r"detection method 'p_true': already the name of a score \(methods/"):
        register(replace_name(METHODS["max"], "p_true"))
    with pytest.raises(ValueError, match="compute 'evaluation.baselines.length' is not a 'module:function' string"):
        from dataclasses import replace

        replace(SCORES["length"], compute="evaluation.baselines.length")
    assert len(SCORES) == 7  # none was registered by the refused calls


def replace_name(declaration, name):
    from dataclasses import replace

    return replace(declaration, name=name)


def test_the_methods_and_the_scores_say_what_they_need_in_one_vocabulary():
    from dataclasses import replace

    from halludetect.methods import SCORES
    from halludetect.methods.spec import NEEDS

    said = {n for d in [*METHODS.values(), *SCORES.values()] for n in d.needs}
    assert said <= set(NEEDS) and said == set(NEEDS)  # each word is used, none is unknown
    with pytest.raises(ValueError, match="score 'length': needs \\('NLI',\\): each one of"):
        replace(SCORES["length"], needs=("NLI",))


def test_no_code_compares_a_kind_of_fit_with_a_string():
    """`Method.fit` was a string once; a Fit never equals one, so a comparison left from then is
    silently false (stages/train.py's count of passes was one). Ask the kind (`fit.loop`,
    `fit.target`) instead."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for path in [*root.glob("halludetect/**/*.py"), *root.glob("stages/*.py"), *root.glob("bench/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            fit = isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "fit"
            if fit and any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in node.comparators):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found

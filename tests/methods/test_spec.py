"""The methods' registry (halludetect/methods/): config's detectors params derive from it, a name
registered twice is refused, an unknown name suggests the closest, and the trait lists are the
paper's (HaMI (SP) alone reads P_sem; the HaMI networks are the ones the sensitivity analysis applies to)."""

import pytest

from halludetect.config import DetectorsParams
from halludetect.core.lookup import UnknownName
from halludetect.detectors.build import DETECTORS
from halludetect.methods import ANALYZABLE, CLUSTER_METHODS, METHODS, SP_METHODS, method, register


def test_registry_covers_every_params_section():
    assert set(DETECTORS) == set(DetectorsParams.model_fields)


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

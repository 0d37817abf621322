"""bench/evidence.py's trace forms: the two layouts it times compute the same norms."""

from support import synthetic

from bench.evidence import trace_forms
from halludetect.detectors.build import build_detector
from halludetect.detectors.data import split_data
from halludetect.methods.pooling import PoolingParams


def test_the_trace_forms_bench_times_two_layouts_of_the_same_norms():
    layer, labels = synthetic()
    train = split_data(layer, labels, "train")
    net = build_detector("max", train.tokens.shape[1], PoolingParams(dim=16, dropout=0.2, lr=1e-2, weight_decay=0.0))
    out = trace_forms(net, train)
    assert out["traced_bags"] == int(train.y.sum()) and out["groups"] >= 1
    assert out["max_relative_difference"] < 1e-12
    assert out["grouped_ms"] > 0 and out["whole_batch_ms"] > 0

"""What token evidence costs, on the world: training with Theorem 2's trace against without it,
and the evidence against a plain forward pass.

  trace     the `max` network trained on one layer (params.yaml's epochs, batch size, one seed)
            with the gradient-ratio trace after every epoch and without it, best of `--repeats`
  evidence  every registered method on that layer's test bags, randomly initialised (the cost is
            the network's, not its weights'): bag logits alone against token evidence, best of 5
  forms     one epoch's trace (`GradientRatioTrace.measure`, the max network at its initial weights)
            with mean pooling's quadratic forms by groups of bags of similar length (as training
            runs it) against on each whole batch padded to its longest bag (the layout before),
            alternating, best of 20 each, and the largest relative difference of the norms
  pieces    decoding the world's test answers token by token (lm/token_text.py), per answer

    python -m bench.evidence [--layer 4] [--epochs 100] [--repeats 2]
"""

from __future__ import annotations

from halludetect.core import numerics

numerics.pin()  # the stages' numerics: one thread, as a train stage's seed workers

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import torch  # noqa: E402

from bench.common import WORLD_MODEL, emit, need  # noqa: E402
from halludetect.activations.layer_format import layer_files  # noqa: E402
from halludetect.activations.layer_reader import read_layer  # noqa: E402
from halludetect.config import ModelPreset, load_params  # noqa: E402
from halludetect.detectors.build import DETECTORS, build_detector, section  # noqa: E402
from halludetect.detectors.data import split_data  # noqa: E402
from halludetect.detectors.evidence import evidence, has_evidence  # noqa: E402
from halludetect.detectors.gradient_ratio import GradientRatioTrace, WidthGroup  # noqa: E402
from halludetect.detectors.training import train_detector  # noqa: E402
from halludetect.lm.hf_models import load_tokenizer  # noqa: E402
from halludetect.lm.token_text import char_spans, token_pieces  # noqa: E402
from halludetect.methods import method as lookup_method  # noqa: E402
from halludetect.qa.responses import response_ids  # noqa: E402

CELL = Path("data/activations/world/world")
LABELS = Path("data/labels/world/world")
GENERATIONS = Path("data/generations/world/world.parquet")


def best_of(n: int, fn) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def trace_forms(net, train) -> dict:
    """One epoch's trace by length groups (as training runs it) against each batch as one group
    padded to its longest bag (the former layout), the same weights."""
    net.eval()
    grouped = GradientRatioTrace.for_training(net, train)
    whole = GradientRatioTrace.sharing(grouped)
    whole.batches = [
        type(b)(
            b.bags,
            b.tokens64,
            b.gram,
            [WidthGroup(torch.arange(len(b.bags)), b.bags.mask, torch.arange(len(b.bags.tokens)), b.gram)],
        )
        for b in grouped.batches
    ]
    times = {"grouped": [], "whole_batch": []}
    for _ in range(20):
        for name, trace in (("grouped", grouped), ("whole_batch", whole)):
            t0 = time.perf_counter()
            trace.measure(net)
            times[name].append(time.perf_counter() - t0)
    a, b = grouped.measure(net), whole.measure(net)
    rel = max(float(np.max(np.abs(a[k] - b[k]) / np.abs(b[k]))) for k in ("max_norm2", "mean_norm2"))
    return {
        "traced_bags": len(a["T"]),
        "groups": sum(len(batch.groups) for batch in grouped.batches),
        "grouped_ms": min(times["grouped"]) * 1e3,
        "whole_batch_ms": min(times["whole_batch"]) * 1e3,
        "ratio_whole_over_grouped": min(times["whole_batch"]) / min(times["grouped"]),
        "max_relative_difference": rel,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", type=int, default=None, help="default: the last dumped layer")
    ap.add_argument("--epochs", type=int, default=None, help="default: train.epochs of params.yaml")
    ap.add_argument("--repeats", type=int, default=2, help="trainings of each kind (best of)")
    args = ap.parse_args()
    need(CELL, LABELS / "judgments.parquet", GENERATIONS, WORLD_MODEL)
    params = load_params()
    files = layer_files(CELL)
    layer = args.layer if args.layer is not None else max(files)
    judgments = pl.read_parquet(LABELS / "judgments.parquet")
    data = read_layer(files[layer], dtype=None)
    train, val, test = (split_data(data, judgments, s) for s in ("train", "val", "test"))
    epochs, batch_size = args.epochs or params.train.epochs, params.train.batch_size
    mp = params.detectors.max

    def run(trace: bool):
        return lambda: train_detector(
            "max", mp, train, val, epochs=epochs, batch_size=batch_size, seed=0, trace_gradient_ratio=trace
        )

    plain_s, traced_s = [], []
    for _ in range(args.repeats):  # alternating, so that a busy moment hits both
        plain_s.append(best_of(1, run(False)))
        traced_s.append(best_of(1, run(True)))

    forms = trace_forms(build_detector("max", train.tokens.shape[1], mp), train)

    per_method = {}
    for method in DETECTORS:
        torch.manual_seed(0)
        net = build_detector(method, test.tokens.shape[1], section(params.detectors, method)).eval()
        if not has_evidence(net):  # EigenScore: a question's answers together, no token split
            per_method[method] = {"evidence": None}
            continue
        spec = lookup_method(method)
        # the bags it can score (SEP (SLT): two tokens at least), P_sem for the methods that scale by it
        bags = test.bags(torch.nonzero(test.lengths >= spec.reads.min_tokens).squeeze(1))
        bags.p_sem = torch.full((len(bags),), 0.5) if spec.reads.p_sem else None
        with torch.no_grad():
            forward_s = best_of(5, lambda: net(bags))  # noqa: B023
        evidence_s = best_of(5, lambda: evidence(net, bags))  # noqa: B023
        per_method[method] = {"bags": len(bags), "forward_ms": forward_s * 1e3, "evidence_ms": evidence_s * 1e3}

    tok = load_tokenizer(ModelPreset(path=str(WORLD_MODEL)))
    gens = pl.read_parquet(GENERATIONS)
    rid = set(test.response_ids)
    answers = gens.filter(response_ids(gens).is_in(rid)).select("text", "token_ids").to_dicts()
    t0 = time.perf_counter()
    exact = sum(char_spans(token_pieces(tok, a["token_ids"]), a["text"]).exact for a in answers)
    pieces_s = time.perf_counter() - t0

    emit(
        {
            "bench": "evidence",
            "layer": layer,
            "epochs": epochs,
            "train_bags": len(train),
            "positive_train_bags": int(train.y.sum()),
            "max_training_s": {"plain": min(plain_s), "with_trace": min(traced_s)},
            "trace_overhead": min(traced_s) / min(plain_s) - 1,
            "trace_forms": forms,
            "test_bags": len(test),
            "test_tokens": int(test.lengths.sum()),
            "per_method": per_method,
            "pieces_answers": len(answers),
            "pieces_ms_per_answer": pieces_s / len(answers) * 1e3,
            "pieces_exact_offsets": exact,
        }
    )


if __name__ == "__main__":
    main()

"""What one more response costs a method, amortised over batches, for the report's block of the
field's baselines and its throughput table: its own scoring plus what it needs beyond the answer.
No torch here: a score's evaluate stage (stages/evaluate_score.py), which never loads a model, uses it too."""

from __future__ import annotations


def cost_per_response(
    needs: tuple[str, ...],
    detector_samples_per_s: float,
    *,
    extra_seconds: float = 0.0,
    extra_what: str = "",
) -> dict:
    """What one more response costs a method, amortised over batches: its own scoring (1 / its
    preloaded throughput) plus what it needs beyond the answer (`extra_seconds`: more samples,
    NLI calls, another forward pass), with what it needs; the report's block of baselines and
    its throughput table read it."""
    own = 1.0 / detector_samples_per_s
    seconds = own + extra_seconds
    return {
        "needs": list(needs),
        "seconds": seconds,
        "samples_per_s": 1.0 / seconds,
        "scoring_seconds": own,
        "extra_seconds": extra_seconds,
        "what": "amortised seconds per response: scoring" + (f" + {extra_what}" if extra_what else ""),
    }


def sampling_seconds(generation_metrics: dict) -> tuple[float, float]:
    """(K, seconds of the K - 1 more samples a response needs) from generate's metrics."""
    k = generation_metrics["samples"] / generation_metrics["questions"]
    return k, (k - 1) * generation_metrics["seconds_per_sample"]

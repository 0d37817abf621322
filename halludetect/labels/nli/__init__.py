"""Entailment backends (registry), semantic clustering, semantic probability and entropy."""

from halludetect.labels.nli.backends import get_nli, nli_from
from halludetect.labels.nli.clustering import (
    CLUSTERS_SCHEMA,
    EQUIVALENCE,
    TIMINGS_SCHEMA,
    cluster_all,
    cluster_question,
    cluster_responses,
    unusable_clustering,
)

__all__ = [
    "CLUSTERS_SCHEMA",
    "EQUIVALENCE",
    "TIMINGS_SCHEMA",
    "cluster_all",
    "cluster_question",
    "cluster_responses",
    "get_nli",
    "nli_from",
    "unusable_clustering",
]

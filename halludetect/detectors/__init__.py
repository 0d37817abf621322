"""MIL detectors: a registry of bag scorers over packed token states (see bags.py)."""

from halludetect.detectors.bags import Bags, gather_rows, pad_bags
from halludetect.detectors.registry import (
    DETECTORS,
    build_detector,
    load_detector,
    params_for,
    save_detector,
    section,
    trained_params,
)

__all__ = ["DETECTORS", "Bags", "build_detector", "gather_rows", "load_detector", "pad_bags", "params_for",
           "save_detector", "section",
           "trained_params"]

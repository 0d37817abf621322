"""MIL detectors: a registry of bag scorers over padded, masked token states."""

from halludetect.detectors.bags import pad_bags
from halludetect.detectors.registry import DETECTORS, build_detector, load_detector, save_detector

__all__ = ["DETECTORS", "build_detector", "load_detector", "pad_bags", "save_detector"]

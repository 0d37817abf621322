"""Around the pipeline: sweeps over DVC experiments into tables, training one layer from a shared
DVC remote, and cross-dataset transfer (one dataset's detectors on another's test split).
"""

"""Around the pipeline: sweeps over DVC experiments into tables, and training one layer from a shared
DVC remote.
"""

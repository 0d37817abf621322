"""Hidden states: capture through one context manager, the per-layer HDF5 files (format, writer,
reader), packed bags of token states, and the states of freshly sampled answers for scoring.
"""

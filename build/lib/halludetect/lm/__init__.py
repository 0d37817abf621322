"""The base language model: loading (transformers), prompt inputs, the model manifest, sampling, and
data-parallel workers.
"""

"""Benchmarks: `python -m bench.<name>`; each prints one JSON object on its last line.

Every figure is a ratio against a baseline measured side by side in the same run, because
the machines are noisy. `make bench` builds what they need (the demo world) and runs them all.
"""

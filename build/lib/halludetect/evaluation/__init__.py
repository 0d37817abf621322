"""Evaluating detectors and the scores without hidden states: best layer on validation, metrics,
baselines, HaMI (SP)'s latency, and the paper's sensitivity analysis.
"""

"""Test doubles shipped with the library: a fake OpenAI-compatible server for offline runs of the judge
and the clustering.
"""

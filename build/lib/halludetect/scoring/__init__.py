"""Scoring new answers with an exported detector bundle (`halludetect score`): the bundle file, the
input and output files, and the resumable scorer.
"""

"""MIL detectors over packed token states (activations/bags.py): the networks and their pooling,
building, saving and loading a detector (build.py), split data (data.py), training and inference.

What a method *is* (its params, traits and which network it builds) is declared in methods/.
"""

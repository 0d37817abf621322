"""Labels of sampled answers: the LLM judge (judges/), entailment clustering for P_sem (nli/), the
OpenAI-compatible chat client and its call cache, answer text helpers, and the checked readers of
the tables they write (readers.py), and the clustering's outputs routed to the detectors that read
them (routing.py).

Nothing is imported here: training reads the label tables through readers.py without loading the
judge's or the clustering's code.
"""

"""The offline demo world: a knowledge base of fictional people (`kb.py`), a tiny Llama with its
own tokenizer trained on it (`tiny_llama.py`), built by `build.py` and checked by `check.py`;
its second dataset, the best-known people and their one-letter look-alikes (`lookalike.py`).

Asked in the paper's prompt format, the model answers what it saw often and fluently
hallucinates the rest: a real hidden-state signal, through the code path that loads Llama-3.1-8B.
"""

"""Tiny models built locally, no hub: for tests, benchmarks and the CPU recipes.

``tiny_model.py``: a tiny Qwen2 with a character tokenizer (the embedded task's model); ``tiny_bpe.py``: the same
with a byte-level BPE tokenizer and a chat template; ``tiny_vlm.py``: a tiny LLaVA vision-language model.
"""

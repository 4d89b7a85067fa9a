"""The garbage collector over a process's start-up: off while the heavy imports run, then the heap they built frozen.

Importing torch and transformers allocates a few million objects that live as long as the process (modules,
functions, classes, dispatch tables). CPython's cyclic collector scans that growing heap again and again while it is
built (~15 % of a trainer rank's or an HF worker's import CPU on 2 cores: ~0.9 of ~5.8 CPU-s) and once more at
interpreter exit (~0.6 s of a rank's ~0.8 s teardown). An entry point (``recipes/grpo.py``'s ``__main__``, ``python
-m workers``) calls ``gc.disable()`` before its imports and :func:`freeze_import_heap` once they are done: one
collection frees what the imports left as garbage, ``gc.freeze()`` moves every survivor to the permanent
generation, which no later collection (nor the exit's) scans, and collection resumes for what the run allocates.
Library code never calls either: disabling the collector is the process owner's choice.

Who blocks on what: nothing; :func:`freeze_import_heap` runs one full collection in the caller's thread.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_import_heap"]


def freeze_import_heap(*modules: str) -> None:
    """Imports ``modules`` (what the entry point would import lazily later, e.g. ``transformers.modeling_utils``),
    collects once, freezes every object alive (``gc.freeze``) and re-enables the collector.

    Call it after the imports, before the run allocates anything large: objects frozen here are only freed by
    reference counting from then on (a module's objects, which live as long as the process anyway).
    """
    import importlib

    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.enable()

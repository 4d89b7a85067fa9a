"""The garbage collector over a process's start-up: off while the heavy imports run, then the heap they built frozen.

Importing torch and transformers allocates a few million objects that live as long as the process (modules,
functions, classes, dispatch tables). CPython's cyclic collector scans that growing heap again and again while it is
built (~15 % of a trainer rank's or an HF worker's import CPU on 2 cores: ~0.9 of ~5.8 CPU-s; gc CPU over a rank's
start-up 1.04 -> 0.40 s). An entry point (``recipes/grpo.py``'s ``__main__``, ``python -m workers``) calls
``gc.disable()`` before its imports and :func:`freeze_import_heap` once they are done: one collection frees what the
imports left as garbage, ``gc.freeze()`` moves every survivor to the permanent generation, which no later collection
of the run scans, and collection resumes for what the run allocates. Library code never calls either: disabling the
collector is the process owner's choice.

At exit the heap is unfrozen again: the interpreter's last collection must see it, or objects of extension modules
held in import-time cycles outlive finalization (triton's nanobind types then print "nanobind: leaked N instances"
at every exit). That last sweep costs what it cost before (~1 s of a rank's teardown on a busy 2-core machine).

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
    import atexit
    import importlib

    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.enable()
    atexit.register(gc.unfreeze)  # registered first, so run after the others: the exit's sweep sees everything

"""Generators of the docs pages that are read off the code and the benchmark results.

``python -m docs._gen`` rewrites them all; ``python -m docs._gen --check`` exits 1 naming every page that is out
of date (``tests/unit/docs/test_docs_generated.py`` runs the check). Each generator is a module with
``render() -> dict[Path, str]``: the files it owns (or the marked block of a file) and their new text.
"""

"""mkdocs hooks (``hooks:`` in ``mkdocs.yml``): the site renders what ``tests/integration/test_docs_snippets.py``
reads.

A block marked ```` ```python skip ```` (a fragment shown out of its context) is not run by the snippet test, but
``pymdownx.superfences`` does not take ``skip`` for a fence option: the fence is left as text and everything up to
the next fence renders as code. The mark is for the test alone, so the site sees a plain ```` ```python ```` fence.
"""

from __future__ import annotations

import re

SKIP_FENCE = re.compile(r"^([ \t]*```python)[ \t]+skip[ \t]*$", re.MULTILINE)


def on_page_markdown(markdown: str, **_: object) -> str:
    return SKIP_FENCE.sub(r"\1", markdown)

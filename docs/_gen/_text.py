"""Small helpers shared by the generators: Sphinx markup to Markdown, table cells, marked blocks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
DOCS = ROOT / "docs"

_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|obj|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")


def markdown(text: str) -> str:
    """A docstring (Sphinx/RST inline markup) as one line of Markdown: roles and double backticks become code."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1] if m.group(0).count('~') else m.group(1)}`", text)
    text = _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)
    return " ".join(text.split())


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


BEGIN = "<!-- BEGIN GENERATED: {name} (python -m docs._gen; do not edit by hand) -->"
END = "<!-- END GENERATED: {name} -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block between the ``name`` markers replaced by ``body``.

    Raises:
        ValueError: the markers are missing, naming the file's expected marker lines.
    """
    begin, end = BEGIN.format(name=name), END.format(name=name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no generated block {name!r}: add the lines\n{begin}\n{end}")
    return text[: start + len(begin)] + "\n" + body.strip("\n") + "\n" + text[stop:]

"""``docs/reference/cli.md``: the ``asyncrl`` command's ``--help``, and each subcommand's, as they print.

The subcommands are read off the command itself (the choices ``asyncrl --help`` lists), and each one's help is
what ``asyncrl SUB --help`` prints at 100 columns (called in this process: ``asyncrl.cli.main``), so a new option,
subcommand or help text regenerates the page with no change here.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

from docs._gen._text import DOCS

PAGE = DOCS / "reference" / "cli.md"
COLUMNS = "100"


def _help(*args: str) -> str:
    from asyncrl.cli import main

    out, saved = io.StringIO(), {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR", "FORCE_COLOR")}
    os.environ.update(COLUMNS=COLUMNS, NO_COLOR="1")  # argparse wraps at $COLUMNS; 3.14 colours unless NO_COLOR
    os.environ.pop("FORCE_COLOR", None)
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*args, "--help"])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    if not out.getvalue().startswith("usage:"):
        raise RuntimeError(f"asyncrl {' '.join(args)} --help printed no usage:\n{out.getvalue()[:2000]}")
    return out.getvalue().rstrip()


def _subcommands(top: str) -> list[str]:
    match = re.search(r"\{([a-z_,-]+)\}", top)
    if match is None:
        raise ValueError(f"no subcommands found in `asyncrl --help`:\n{top[:500]}")
    return match.group(1).split(",")


def render() -> dict[Path, str]:
    top = _help()
    parts = [
        "# Command line",
        "",
        "Generated from the commands' own `--help` by `python -m docs._gen` (at 100 columns); "
        "`tests/unit/docs/test_docs_generated.py` fails while this page differs from what they print.",
        "",
        "The `asyncrl` command is installed with the package (`pip install -e .`). The recipe itself is a script "
        "run with `torchrun` (see [the recipe](../guides/recipe.md)).",
        "",
        "## asyncrl",
        "",
        "```text",
        top,
        "```",
        "",
    ]
    for sub in _subcommands(top):
        parts += [f"## asyncrl {sub}", "", "```text", _help(sub), "```", ""]
    return {PAGE: "\n".join(parts).rstrip() + "\n"}


if __name__ == "__main__":
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)

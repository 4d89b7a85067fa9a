"""``docs/reference/cli.md``: the ``asyncrl`` command's ``--help``, and each subcommand's, as they print.

The subcommands are read off the command itself (the choices ``asyncrl --help`` lists), and each one's help is
what ``python -m asyncrl.cli SUB --help`` prints at 100 columns, so a new option, subcommand or help text
regenerates the page with no change here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from docs._gen._text import DOCS, ROOT

PAGE = DOCS / "reference" / "cli.md"
COLUMNS = "100"


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": COLUMNS, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", *args, "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"asyncrl {' '.join(args)} --help exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stdout.rstrip()


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
        "`tests/unit/test_docs_generated.py` fails while this page differs from what they print.",
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

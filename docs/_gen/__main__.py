"""``python -m docs._gen [--check] [NAME ...]``: rewrite the generated docs pages, or check that they are current.

Names: ``config``, ``cli``, ``api``, ``benchmarks`` (default: all). ``--check`` writes nothing and exits 1 naming each file
whose committed text differs from what its generator writes now.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from pathlib import Path

from docs._gen._text import ROOT

GENERATORS = {"config": "docs._gen.config_reference", "cli": "docs._gen.cli_reference",
              "api": "docs._gen.api_reference", "benchmarks": "docs._gen.benchmark_pages"}


def stale(names: list[str]) -> dict[Path, str]:
    """``{file: unified diff}`` for every generated file that differs from its generator's output."""
    out = {}
    for name in names:
        for path, text in importlib.import_module(GENERATORS[name]).render().items():
            old = path.read_text() if path.exists() else ""
            if old != text:
                rel = str(path.relative_to(ROOT))
                out[path] = "".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                         f"{rel} (committed)", f"{rel} (generated)", n=1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs._gen", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(GENERATORS)} (default: all)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    names = args.names or list(GENERATORS)
    if unknown := sorted(set(names) - set(GENERATORS)):
        parser.error(f"unknown generators {unknown}; choose from {list(GENERATORS)}")
    if args.check:
        diffs = stale(names)
        for diff in diffs.values():
            sys.stdout.write(diff)
        return 1 if diffs else 0
    for name in names:
        for path, text in importlib.import_module(GENERATORS[name]).render().items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

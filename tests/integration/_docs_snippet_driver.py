"""Runs the code blocks of one docs page in order, as a reader would (driver of test_docs_snippets).

``python _docs_snippet_driver.py BLOCKS.json`` in a scratch directory: BLOCKS is a list of ``{"lang", "code",
"line"}``. ``python`` blocks are executed in this process's ``__main__`` namespace, one after the other, so a later
block sees what an earlier one defined (and ``module:function`` specs may name ``__main__``); ``bash`` blocks run
with ``bash -e`` in the same directory; ``yaml`` blocks must load as (a fragment of) the recipe's run file. Each
block prints a marker when it starts; a failing one exits 1 naming its line in the page.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback


def _run_yaml(code: str) -> None:
    import yaml

    from asyncrl.config import from_dict
    from docs._gen.config_reference import _root_classes

    tree = yaml.safe_load(code)
    if not isinstance(tree, dict):
        raise ValueError(f"a yaml block must be a mapping of run-file keys, got {type(tree).__name__}")
    from_dict(_root_classes()[0], tree)  # unknown keys, wrong types and cross-field errors raise here


def main() -> int:
    blocks = json.loads(open(sys.argv[1]).read())
    namespace = sys.modules["__main__"].__dict__
    for block in blocks:
        print(f"=== block at line {block['line']} ({block['lang']})", flush=True)
        try:
            if block["lang"] == "python":
                exec(compile(block["code"], f"<docs block at line {block['line']}>", "exec"), namespace)
            elif block["lang"] == "bash":
                subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block["code"]], check=True)
            elif block["lang"] == "yaml":
                _run_yaml(block["code"])
            else:
                raise ValueError(f"no runner for {block['lang']!r}")
        except BaseException:  # deliberate: report which block of the page failed, then fail the run
            traceback.print_exc()
            print(f"FAILED: the {block['lang']} block at line {block['line']}", flush=True)
            return 1
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)  # a block's leftover non-daemon threads must not keep a finished page alive

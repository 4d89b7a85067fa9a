"""Every code block of the README and of the docs' guides and concepts runs, so the docs cannot drift from the code.

Each page's blocks run in order in a fresh interpreter in a scratch directory (``_docs_snippet_driver.py``), as a
reader would paste them: a later block may use what an earlier one defined or built. What runs:

- ```` ```python ````: executed (with the real engines the text names: the HF engine on the tiny model, built
  locally; ``HF_HUB_OFFLINE=1``).
- ```` ```bash ````: run with ``bash -e``, except lines that start with a command in ``NOT_RUN`` (``make``, which
  sets up a virtualenv and runs the full job or suite; ``torchrun``, a multi-process training run of minutes;
  ``pip``, an install). A bash block made only of such lines runs nothing.
- ```` ```yaml ````: loaded into the recipe's run-file config (unknown keys, wrong types and cross-field errors
  fail), since a run file is what a yaml block in these pages is.

Not run, and marked so on the page: ```` ```python skip ```` (a fragment shown out of its context, which runs
elsewhere on the site), ```` ```text ```` (diagrams, command lines with placeholders such as ``DIR``, outputs).
A fence in any other language fails the test, so a new block is either run or marked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", DOCS / "index.md", DOCS / "limits.md", *DOCS.glob("guides/*.md"),
                *DOCS.glob("concepts/*.md")])
"""Hand-written pages whose blocks run. Not here: the generated reference and benchmark pages (no runnable blocks;
the staleness test covers them), the install and development pages (shell set-up: virtualenvs, pip, make)."""
RUN = {"python", "bash", "yaml"}
MARKED = {("python", "skip"), ("text", "")}
NOT_RUN = ("make", "torchrun", "pip")
FENCE = re.compile(r"^```([\w-]*)[ \t]*([\w-]*)[ \t]*$")


def blocks(text: str) -> list[dict]:
    """The fenced blocks of a Markdown page: ``{"lang", "tag", "code", "line"}`` (line: of the opening fence)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        out.append({"lang": match.group(1), "tag": match.group(2), "code": "\n".join(body) + "\n", "line": start})
        i += 1
    return out


def _runnable_bash(code: str) -> str:
    logical = re.sub(r"[ \t]*\\\n\s*", " ", code).splitlines()  # backslash continuations joined
    kept = [line for line in logical if line.strip() and line.split()[0] not in NOT_RUN]
    return "\n".join(kept) + "\n" if kept else ""


def to_run(page: Path) -> list[dict]:
    """The page's blocks that run; raises for a fence that is neither run nor explicitly marked."""
    out = []
    for b in blocks(page.read_text()):
        if (b["lang"], b["tag"]) in MARKED:
            continue
        if b["lang"] not in RUN or b["tag"]:
            raise AssertionError(f"{page.relative_to(ROOT)}:{b['line']}: a ```{b['lang']} {b['tag']}``` block is "
                                 f"neither run ({sorted(RUN)}) nor marked as not run ({sorted(MARKED)})")
        if b["lang"] == "bash":
            b = {**b, "code": _runnable_bash(b["code"])}
            if not b["code"]:
                continue
        out.append(b)
    return out


def test_the_block_parser_and_the_markers():
    page = "x\n```python\na = 1\n```\n```python skip\nnope\n```\n```bash\nmake run\necho hi \\\n  there\n```\n" \
           "```text\nDIR\n```\n```yaml\nrollout: {max_staleness: 0}\n```\n"
    found = blocks(page)
    assert [(b["lang"], b["tag"], b["line"]) for b in found] == [
        ("python", "", 2), ("python", "skip", 5), ("bash", "", 8), ("text", "", 13), ("yaml", "", 16)]
    assert _runnable_bash(found[2]["code"]) == "echo hi there\n"
    assert _runnable_bash("make run\ntorchrun x\n") == ""


def test_every_fence_is_run_or_marked():
    for page in PAGES:
        to_run(page)  # raises naming the page and line


def _with_blocks(pages: list[Path]) -> list[Path]:
    """The pages with a block to run (a page whose fences are wrong is kept: its test then fails, naming them)."""
    out = []
    for page in pages:
        try:
            if to_run(page):
                out.append(page)
        except AssertionError:
            out.append(page)
    return out


@pytest.mark.parametrize("page", _with_blocks(PAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_code_blocks_of_a_page_run(page, tmp_path):
    runnable = to_run(page)
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    venv_bin = str(Path(sys.executable).parent)  # `asyncrl` and `python` of this interpreter's environment
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": f"{venv_bin}:{os.environ['PATH']}",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_docs_snippet_driver.py")),
                           str(tmp_path / "blocks.json")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (f"{page.relative_to(ROOT)}: a code block failed\n{proc.stdout[-4000:]}\n"
                                  f"{proc.stderr[-6000:]}")

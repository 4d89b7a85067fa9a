"""The commands the recipe's docstring and its guide give are ones the recipe accepts: each ``torchrun ...
recipes/grpo.py ...`` line goes through the recipe's own command-line parser and run-file loader (every override a
known key, every value valid, the trackers it names installed), and the guide's lines are the docstring's. That the
commands also run and learn is measured by ``benchmarks/recipe_learning.py`` (benchmarks/results/) and launched in
tests/integration/test_recipe.py and test_recipe_outputs.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from asyncrl import load_config
from asyncrl.integrations.trackers import resolve_report_to
from recipes import grpo

ROOT = Path(__file__).parents[3]
COMMAND = re.compile(r"^\s*(torchrun [^\n`]*recipes/grpo\.py [^\n`]*)$", re.MULTILINE)


def _commands(text: str) -> list[list[str]]:
    """Each command line's argv after ``recipes/grpo.py``, with torchrun's own options dropped."""
    found = []
    for line in COMMAND.findall(text):
        argv = shlex.split(line)
        found.append(argv[argv.index("recipes/grpo.py") + 1:])
    return found


DOCSTRING = _commands(grpo.__doc__)
GUIDE = _commands((ROOT / "docs" / "guides" / "recipe.md").read_text())


def test_the_docstring_and_the_guide_give_commands_and_the_guide_s_are_the_docstring_s():
    assert len(DOCSTRING) >= 4 and GUIDE  # a moved docstring or page does not pass by finding nothing
    assert any("lora.rank=8" in argv for argv in DOCSTRING) and any("lora.rank=8" in argv for argv in GUIDE)
    for argv in GUIDE:
        assert argv in DOCSTRING, f"docs/guides/recipe.md gives {shlex.join(argv)}, which recipes/grpo.py's docstring does not"


@pytest.mark.parametrize("argv", DOCSTRING, ids=[shlex.join(a[2:]) or "defaults" for a in DOCSTRING])
def test_each_command_of_the_docstring_is_accepted_by_the_recipe(argv, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands are run from the repository's root
    args = grpo.parse_args(argv)
    assert args.config and Path(args.config).is_file(), argv
    cfg = load_config(args.config, args.overrides)
    for override in args.overrides:  # each override took effect (none is swallowed by a later default)
        key, value = override.split("=", 1)
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert str(node).replace("'", "").replace(" ", "") == value or node == type(node)(value), (key, node, value)
    try:
        resolve_report_to(cfg.report_to)
    except ValueError as e:  # the trackers are optional extras: not installed here is the extras' business
        pytest.skip(str(e))


def test_make_run_is_the_docstring_s_first_command():
    """``make run`` (what tests/integration/test_recipe_outputs.py launches, with fewer steps) is a documented one."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run:.*\n\t(.*)$", makefile, re.MULTILINE).group(1)
    argv = shlex.split(recipe)
    assert argv[argv.index("recipes/grpo.py") + 1:] == DOCSTRING[0] == ["--config", "recipes/configs/tiny_cpu.yaml"]
    assert "--nproc-per-node" in argv and argv[argv.index("--nproc-per-node") + 1] == "2"

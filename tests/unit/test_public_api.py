"""The public surface: ``asyncrl`` exports what the recipe and the drop-in loop use and every config class, not the
pool's internals; the recipes take every public name from ``asyncrl`` (read from their source, nothing run)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import asyncrl
import asyncrl.config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [ROOT / "recipes" / "grpo.py", ROOT / "recipes" / "drop_in.py"]
INTERNALS = {"PromptLedger", "RolloutPool", "Timeline", "new_incarnation", "is_stale"}


def test_the_loop_s_names_are_exported_and_the_internals_are_not():
    loop = {"RolloutLoader", "Checkpointer", "UpdateGuard", "GuardConfig", "PolicySync", "batch_logprobs",
            "hold_run_dir", "continue_records", "DataConfig", "compute_loss", "LossConfig", "RewardSet",
            "setup_weight_broadcaster", "setup_weight_receiver", "staleness"}
    assert loop <= set(asyncrl.__all__)
    assert not INTERNALS & set(asyncrl.__all__)
    for name in INTERNALS:
        with pytest.raises(AttributeError):
            getattr(asyncrl, name)
    assert asyncrl.__all__ == sorted(asyncrl.__all__)


def test_every_config_class_is_public():
    configs = {n for n in asyncrl.config.__all__ if dataclasses.is_dataclass(getattr(asyncrl.config, n))}
    assert configs - {"TestingConfig", "FaultConfig", "ModelEngineConfig"} <= set(asyncrl.__all__)


@pytest.mark.parametrize("name", asyncrl.__all__)
def test_every_public_name_resolves(name):
    assert getattr(asyncrl, name) is not None


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_the_recipes_import_public_names_from_asyncrl(path):
    tree = ast.parse(path.read_text())
    public = set(asyncrl.__all__)
    deep = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("asyncrl.") for a in n.names if a.name in public]
    assert not deep, f"{path.name}: import these from asyncrl: {deep}"
    used = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "asyncrl" for a in n.names}
    assert used <= public

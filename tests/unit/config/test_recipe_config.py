"""asyncrl.config.RecipeConfig: every shipped run file loads; typos and bad values fail with the key and the choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import RecipeConfig, load_config

CONFIGS = sorted((Path(__file__).parents[3] / "recipes" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_run_file_loads(path):
    assert isinstance(load_config(str(path), []), RecipeConfig)


def test_dotted_overrides_reach_the_section():
    cfg = load_config(None, ["train.steps=7", "lora.rank=4", "weights.type=zmq"])
    assert (cfg.train.steps, cfg.lora.rank, cfg.weights.type) == (7, 4, "zmq")
    assert load_config(None, []).weights.type == "shm"  # the recipe's default channel, not WeightSyncConfig's "none"


def test_an_unknown_key_and_a_bad_save_point_are_refused():
    with pytest.raises((KeyError, ValueError, TypeError), match="stpes"):
        load_config(None, ["train.stpes=7"])
    with pytest.raises(ValueError, match="pause_in_save_point='halfway' must be one of"):
        load_config(None, ["testing.pause_in_save_point=halfway"])

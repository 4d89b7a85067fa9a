"""The ``cluster`` section: parsed from run files and overrides, refused with the key when wrong."""

from __future__ import annotations

import pytest

from asyncrl.config import ClusterConfig, FleetConfig, GangConfig, load_config


def test_default_is_local_and_leaves_the_recipe_alone():
    cfg = load_config("recipes/configs/tiny_cpu.yaml", [])
    assert cfg.cluster.engine == "local" and cfg.cluster.trainer.max_restarts == 0


def test_overrides_reach_the_nested_sections():
    cfg = load_config("recipes/configs/tiny_cpu.yaml", [
        "cluster.engine=ray", "cluster.trainer.nnodes=2", "cluster.trainer.max_restarts=2",
        "cluster.fleet.min_workers=2", "cluster.fleet.max_workers=4", "cluster.fleet.resources={asyncrl_rollout: 2}"])
    assert cfg.cluster.engine == "ray" and cfg.cluster.trainer.world_size == 2
    assert cfg.cluster.fleet.max_workers == 4 and cfg.cluster.fleet.resources == {"asyncrl_rollout": 2}


def test_unknown_key_is_refused_with_the_closest():
    with pytest.raises(ValueError, match="max_restarts"):
        load_config("recipes/configs/tiny_cpu.yaml", ["cluster.trainer.max_restart=1"])


@pytest.mark.parametrize("bad, match", [
    (lambda: ClusterConfig(engine="k8s"), "cluster.engine"),
    (lambda: GangConfig(nnodes=0), "nnodes"),
    (lambda: GangConfig(strategy="RANDOM"), "strategy"),
    (lambda: GangConfig(max_restarts=-1), "max_restarts"),
    (lambda: FleetConfig(min_workers=3, max_workers=2), "max_workers"),
    (lambda: FleetConfig(weights="nccl"), "weights"),
    (lambda: FleetConfig(restart_backoff_s=10, restart_backoff_max_s=1), "restart_backoff"),
])
def test_bad_values_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()

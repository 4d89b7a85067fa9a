"""Placement computed without Ray: bundles, ranks by node IP, torchrun's variables, the fleet's plan, weight paths."""

from __future__ import annotations

import pytest

from asyncrl.cluster.placement import (
    PlacedBundle,
    assign_ranks,
    backoff_s,
    fleet_target,
    free_resources,
    gang_bundles,
    node_capacity,
    torchrun_env,
    weight_path,
    worker_resources,
)
from asyncrl.config import FleetConfig, GangConfig


def test_gang_bundles_one_per_rank_with_resources():
    gang = GangConfig(nnodes=2, ranks_per_node=4, gpus_per_rank=1, cpus_per_rank=2)
    bundles = gang_bundles(gang)
    assert len(bundles) == 8 and bundles[0] == {"CPU": 2.0, "GPU": 1.0, "asyncrl_trainer": 1.0}
    assert gang_bundles(GangConfig(gpus_per_rank=0, resources={}))[0] == {"CPU": 1.0}


def test_ranks_sorted_by_node_ip_then_node_then_bundle():
    placed = [PlacedBundle(0, "n-b", "10.0.0.12"), PlacedBundle(1, "n-a", "10.0.0.9"),
              PlacedBundle(2, "n-b", "10.0.0.12"), PlacedBundle(3, "n-a", "10.0.0.9")]
    slots = assign_ranks(placed)
    # 10.0.0.9 < 10.0.0.12 numerically (as text it would sort after)
    assert [(s.rank, s.node_id, s.bundle_index, s.local_rank, s.node_rank) for s in slots] == [
        (0, "n-a", 1, 0, 0), (1, "n-a", 3, 1, 0), (2, "n-b", 0, 0, 1), (3, "n-b", 2, 1, 1)]
    assert {s.local_world_size for s in slots} == {2} and {s.world_size for s in slots} == {4}


def test_fake_nodes_sharing_an_ip_are_told_apart_by_id():
    slots = assign_ranks([PlacedBundle(0, "z", "127.0.0.1"), PlacedBundle(1, "a", "127.0.0.1")])
    assert [(s.node_id, s.local_rank, s.node_rank, s.local_world_size) for s in slots] == [("a", 0, 0, 1), ("z", 0, 1, 1)]


def test_assign_ranks_refuses_nonsense():
    with pytest.raises(ValueError, match="no bundles"):
        assign_ranks([])
    with pytest.raises(ValueError, match="twice"):
        assign_ranks([PlacedBundle(0, "a", "1.2.3.4"), PlacedBundle(0, "b", "1.2.3.5")])


def test_torchrun_env_is_exactly_torchruns_variables():
    slot = assign_ranks([PlacedBundle(0, "a", "10.0.0.1"), PlacedBundle(1, "b", "10.0.0.2")])[1]
    assert torchrun_env(slot, "10.0.0.1", 29500) == {
        "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError):
        torchrun_env(slot, "10.0.0.1", 0)


def test_fleet_capacity_and_target():
    fleet = FleetConfig(workers_per_node=2, gpus_per_worker=1, cpus_per_worker=1)
    assert worker_resources(fleet) == {"CPU": 1.0, "GPU": 1.0, "asyncrl_rollout": 1.0}
    assert node_capacity({"CPU": 8, "GPU": 8, "asyncrl_rollout": 8}, fleet) == 2
    assert node_capacity({"CPU": 8, "GPU": 1, "asyncrl_rollout": 8}, fleet) == 1
    assert node_capacity({"CPU": 8, "GPU": 8}, fleet) == 0  # no rollout resource: no workers there
    assert fleet_target({"b": 2, "a": 2, "c": 0}, fleet) == {"a": 2, "b": 2, "c": 0}
    capped = FleetConfig(workers_per_node=2, max_workers=3)
    assert fleet_target({"b": 2, "a": 2}, capped) == {"a": 2, "b": 1}


def test_the_trainer_s_bundles_are_not_the_fleet_s():
    fleet = FleetConfig(workers_per_node=2)
    gang = gang_bundles(GangConfig(gpus_per_rank=1))
    total = {"CPU": 2, "GPU": 2, "asyncrl_trainer": 1, "asyncrl_rollout": 2}
    assert node_capacity(total, fleet) == 2
    assert free_resources(total, gang) == {"CPU": 1, "GPU": 1, "asyncrl_trainer": 0, "asyncrl_rollout": 2}
    assert node_capacity(free_resources(total, gang), fleet) == 1  # one GPU left beside the rank


def test_weight_path_by_locality():
    assert weight_path("n1", "n1") == "shm" and weight_path("n2", "n1") == "zmq"
    assert weight_path("n1", "n1", "zmq") == "zmq"
    with pytest.raises(ValueError, match="does not cross machines"):
        weight_path("n2", "n1", "shm")


def test_backoff_doubles_to_a_cap():
    assert [backoff_s(n, 1.0, 5.0) for n in range(5)] == [0.0, 1.0, 2.0, 4.0, 5.0]


def test_the_fleet_floor_is_said_when_crossed_not_while_the_fleet_is_first_placed():
    from asyncrl.cluster.placement import fleet_floor

    state, said = None, []
    for live in [0, 1, 2, 3, 1, 1, 2, 0, 2]:  # min_workers=2: placing, reached, lost one, back, lost all, back
        state, event = fleet_floor(state, live, 2)
        said.append(event)
    assert said == [None, None, None, None, "fleet_below_min", None, "fleet_restored", "fleet_below_min",
                    "fleet_restored"]


def test_deltas_only_across_a_network_by_default():
    from asyncrl.cluster.placement import wants_delta

    assert wants_delta("auto", "10.0.0.2", "10.0.0.1") is True  # another host: fewer bytes on the wire
    assert wants_delta("auto", "127.0.0.1", "127.0.0.1") is False  # one host (fake nodes, the relay): a memory copy
    assert wants_delta("auto", "", "10.0.0.1") is True  # unknown address: assume a network
    assert wants_delta(True, "127.0.0.1", "127.0.0.1") is True and wants_delta(False, "10.0.0.2", "10.0.0.1") is False

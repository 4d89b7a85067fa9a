"""Placement as computation: what the Ray engine asks for and what it makes of what it got (no Ray here).

    gang_bundles(gang)              one bundle per rank: {"CPU": c, "GPU": g, "asyncrl_trainer": 1}
    assign_ranks(placed bundles)    bundles sorted by (node IP, node id, bundle index): rank = position; local ranks
                                    count within a node, so a node's ranks are consecutive (torchrun's layout)
    torchrun_env(slot, addr, port)  exactly torchrun's variables for that rank
    fleet_target(nodes, fleet)      how many rollout workers each node should hold now
    weight_path(worker, trainer)    shm on the trainer's node, zmq elsewhere
    wants_delta(choice, ips)        zmq with deltas when a network lies between the worker and the trainer

The rank-0 bundle's node reports its IP and a free port (the Ray engine asks the rank-0 actor); the others get them
as ``MASTER_ADDR``/``MASTER_PORT`` (verl ``single_controller/ray/base.py``, NeMo-RL ``virtual_cluster.py``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from asyncrl.config.cluster import FleetConfig, GangConfig

__all__ = ["PlacedBundle", "RankSlot", "assign_ranks", "backoff_s", "fleet_floor", "fleet_target", "free_resources",
           "gang_bundles", "node_capacity",
           "torchrun_env", "wants_delta", "weight_path", "worker_resources"]


@dataclass(frozen=True, slots=True)
class PlacedBundle:
    """A bundle of the trainer's placement group, where Ray put it."""

    index: int
    node_id: str
    node_ip: str


@dataclass(frozen=True, slots=True)
class RankSlot:
    """One trainer rank: its bundle and its torchrun coordinates."""

    rank: int
    local_rank: int
    node_rank: int
    local_world_size: int
    world_size: int
    bundle_index: int
    node_id: str
    node_ip: str


def _resources(cpus: float, gpus: float, custom: dict[str, float]) -> dict[str, float]:
    out = {"CPU": float(cpus)} if cpus else {}
    if gpus:
        out["GPU"] = float(gpus)
    out.update({k: float(v) for k, v in custom.items() if v})
    return out


def gang_bundles(gang: GangConfig) -> list[dict[str, float]]:
    """The trainer's placement group: ``nnodes * ranks_per_node`` bundles, each one rank's resources."""
    return [_resources(gang.cpus_per_rank, gang.gpus_per_rank, gang.resources) for _ in range(gang.world_size)]


def worker_resources(fleet: FleetConfig) -> dict[str, float]:
    """What one rollout worker actor asks for."""
    return _resources(fleet.cpus_per_worker, fleet.gpus_per_worker, fleet.resources)


def _ip_key(ip: str) -> tuple[int, int | str]:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:  # a hostname: after every address, in text order
        return (1, ip)


def assign_ranks(bundles: list[PlacedBundle]) -> list[RankSlot]:
    """Ranks for placed bundles: sorted by node IP (numerically), then node id (fake nodes share an IP), then bundle
    index, so ranks on one node are consecutive and rank 0 is on the lowest address.

    Raises:
        ValueError: for no bundles or a bundle index given twice.
    """
    if not bundles:
        raise ValueError("assign_ranks: no bundles")
    if len({b.index for b in bundles}) != len(bundles):
        raise ValueError(f"assign_ranks: a bundle index appears twice in {[b.index for b in bundles]}")
    ordered = sorted(bundles, key=lambda b: (_ip_key(b.node_ip), b.node_id, b.index))
    nodes: list[str] = []
    for b in ordered:
        if b.node_id not in nodes:
            nodes.append(b.node_id)
    per_node = {n: sum(b.node_id == n for b in ordered) for n in nodes}
    seen: dict[str, int] = {}
    slots = []
    for rank, b in enumerate(ordered):
        local = seen.get(b.node_id, 0)
        seen[b.node_id] = local + 1
        slots.append(RankSlot(rank=rank, local_rank=local, node_rank=nodes.index(b.node_id),
                              local_world_size=per_node[b.node_id], world_size=len(ordered), bundle_index=b.index,
                              node_id=b.node_id, node_ip=b.node_ip))
    return slots


def torchrun_env(slot: RankSlot, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torchrun gives a rank (what ``init_process_group("env://")`` and the recipe read)."""
    if not 0 < master_port < 65536:
        raise ValueError(f"{master_port=} must be a TCP port")
    return {
        "RANK": str(slot.rank),
        "LOCAL_RANK": str(slot.local_rank),
        "WORLD_SIZE": str(slot.world_size),
        "LOCAL_WORLD_SIZE": str(slot.local_world_size),
        "GROUP_RANK": str(slot.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def node_capacity(available: dict[str, float], fleet: FleetConfig) -> int:
    """How many rollout workers fit in a node's ``available`` resources (at most ``workers_per_node``); 0 for a node
    without the fleet's custom resources."""
    need = worker_resources(fleet)
    fits = [int(available.get(k, 0.0) // v) for k, v in need.items() if v > 0]
    return min([fleet.workers_per_node, *fits])


def free_resources(total: dict[str, float], reserved: list[dict[str, float]]) -> dict[str, float]:
    """A node's ``total`` resources less what ``reserved`` bundles (the trainer's, placed there) hold: what the
    fleet may use on that node."""
    free = dict(total)
    for bundle in reserved:
        for k, v in bundle.items():
            free[k] = free.get(k, 0.0) - v
    return free


def fleet_target(capacity: dict[str, int], fleet: FleetConfig) -> dict[str, int]:
    """Workers each node should hold: its capacity (``node_capacity`` of its total resources), all of them, capped
    at ``max_workers`` by taking nodes in id order (deterministic: the same cluster gives the same plan)."""
    left = fleet.max_workers if fleet.max_workers is not None else sum(capacity.values())
    out = {}
    for node in sorted(capacity):
        n = min(capacity[node], max(0, left))
        out[node] = n
        left -= n
    return out


def weight_path(worker_node_id: str, trainer_node_id: str, choice: str = "auto") -> str:
    """The weight path of a worker on ``worker_node_id`` when the broadcaster (rank 0) runs on ``trainer_node_id``:
    ``shm`` on the same node, ``zmq`` elsewhere (``choice`` ``auto``); ``zmq``/``shm`` force one.

    Raises:
        ValueError: ``shm`` forced for a worker on another node (shared memory does not cross machines).
    """
    if choice == "zmq":
        return "zmq"
    same = worker_node_id == trainer_node_id
    if choice == "shm" and not same:
        raise ValueError(f"cluster.fleet.weights='shm' but a worker is on node {worker_node_id}, not the trainer's "
                         f"rank-0 node {trainer_node_id}: shared memory does not cross machines; use 'auto'")
    return "shm" if same else "zmq"


def wants_delta(choice: "bool | str", worker_ip: str, trainer_ip: str) -> bool:
    """Whether a worker (or a relay) at ``worker_ip`` takes its zmq versions as deltas from the broadcaster at
    ``trainer_ip`` (``cluster.fleet.delta``): ``True``/``False`` force it; ``auto`` takes deltas only across a network,
    i.e. when the two addresses differ. Over one host's loopback a full copy costs a memory copy, while encoding and
    applying a delta costs CPU at both ends that the trainer and the engine share: several Ray nodes on one host (the
    fake cluster, a big machine split in nodes) take full versions."""
    if choice == "auto":
        return not worker_ip or not trainer_ip or worker_ip != trainer_ip
    return bool(choice)


def backoff_s(deaths: int, base: float, cap: float) -> float:
    """Wait before replacing a worker after its ``deaths``-th death in a row: ``base * 2**(deaths-1)``, at most
    ``cap``; 0 before any death."""
    return 0.0 if deaths <= 0 else min(cap, base * 2 ** (deaths - 1))


def fleet_floor(below: bool | None, live: int, min_workers: int) -> tuple[bool | None, str | None]:
    """Whether the fleet is below ``min_workers`` now, and the event to say (``fleet_below_min`` /
    ``fleet_restored``) when that changed. ``below`` None: starting, nothing is said until the fleet first reaches
    ``min_workers`` (a fleet that is still being placed is not one that lost workers)."""
    now_below = live < min_workers
    if below is None:
        return (None if now_below else False), None
    if now_below == below:
        return below, None
    return now_below, "fleet_below_min" if now_below else "fleet_restored"

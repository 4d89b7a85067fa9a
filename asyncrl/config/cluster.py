"""The ``cluster`` section: where a run's processes go when it leaves one machine (``asyncrl launch``).

``engine: local`` is today's path: ``torchrun`` on this machine, local workers as children of each rank (the rest of
this section is ignored). ``engine: ray`` places the trainer gang in one placement group and the rollout fleet as one
actor per worker on a Ray cluster (:mod:`asyncrl.integrations.ray`); ``engine: slurm`` renders an ``sbatch`` script
(:mod:`asyncrl.cluster.slurm`). Plain data: nothing here blocks or starts anything.

::

    cluster
      engine, address, namespace
      trainer   GangConfig    the trainer ranks: nodes, ranks per node, resources, restarts
      fleet     FleetConfig   the rollout workers: how many, where, replacement, weight path
      slurm     SlurmConfig   the sbatch header of ``--engine slurm``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ClusterConfig", "FleetConfig", "GangConfig", "SlurmConfig"]

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(kw_only=True, slots=True)
class GangConfig:
    """The trainer ranks: one placement group of ``nnodes * ranks_per_node`` bundles, one rank per bundle."""

    nnodes: int = 1
    """Nodes the trainer spans (torchrun's ``--nnodes``)."""
    ranks_per_node: int = 1
    """Trainer ranks per node (torchrun's ``--nproc-per-node``; one per GPU on a GPU node)."""
    gpus_per_rank: float = 1.0
    """GPUs each rank's bundle asks for (Ray's ``num_gpus``; logical on a fake node). 0 on a CPU-only cluster."""
    cpus_per_rank: float = 1.0
    """CPUs each rank's bundle asks for."""
    resources: dict[str, float] = field(default_factory=lambda: {"asyncrl_trainer": 1.0})
    """Custom Ray resources each rank's bundle asks for: only nodes started with them (``ray start
    --resources '{"asyncrl_trainer": 8}'``) take trainer ranks."""
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """The placement group's strategy. ``PACK``: as few nodes as fit; ``STRICT_PACK``: one node or nothing."""
    max_restarts: int = 0
    """A dead rank tears the whole gang down and starts it again from the newest complete checkpoint (``--resume``),
    at most this many times (Ray Train's ``FailureConfig(max_failures)``, with asyncrl's own checkpoints); 0: the
    first death ends the run."""
    restart_backoff_s: float = 1.0
    """Wait before restarting the gang after a death."""
    ready_timeout_s: float = 300.0
    """The placement group must be placed within this long (a cluster without the resources fails, naming them)."""

    def __post_init__(self):
        if self.nnodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"cluster.trainer: {self.nnodes=} and {self.ranks_per_node=} must be >= 1")
        if self.gpus_per_rank < 0 or self.cpus_per_rank < 0 or any(v < 0 for v in self.resources.values()):
            raise ValueError(f"cluster.trainer: resources must be >= 0, got {self.gpus_per_rank=}, "
                             f"{self.cpus_per_rank=}, {self.resources=}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"cluster.trainer.strategy={self.strategy!r} must be one of {STRATEGIES}")
        if self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError(f"cluster.trainer: {self.max_restarts=} and {self.restart_backoff_s=} must be >= 0")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_node


@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """The rollout workers: one Ray actor per worker, each running ``asyncrl worker`` against every rank's pool."""

    min_workers: int = 1
    """The fleet's floor: while fewer workers serve (deaths, a node removed, a fleet still being placed) every
    trainer rank pauses (``rollout.min_workers`` is set from this: its loader yields nothing, its wait timeout does
    not run, the groups that arrive are kept) and resumes when capacity returns; the supervisor says so
    (``fleet_below_min``, then ``fleet_restored``, in ``RUN_DIR/cluster/events.jsonl``) and keeps placing workers
    wherever resources allow. 0: no floor, the run goes on with whatever workers it has."""
    max_workers: int | None = None
    """Most workers at once; None: as many as the nodes with rollout resources hold (``workers_per_node`` each)."""
    workers_per_node: int = 1
    """Workers started on each node that has the rollout resources (a node that joins gets this many)."""
    gpus_per_worker: float = 1.0
    """GPUs each worker actor asks for (logical on a fake node; 0 on a CPU-only cluster)."""
    cpus_per_worker: float = 1.0
    """CPUs each worker actor asks for."""
    resources: dict[str, float] = field(default_factory=lambda: {"asyncrl_rollout": 1.0})
    """Custom Ray resources each worker asks for: only nodes started with them take workers."""
    restart_backoff_s: float = 1.0
    """Wait before replacing a dead worker; doubled per death within ``restart_backoff_max_s`` of the last."""
    restart_backoff_max_s: float = 30.0
    """Longest wait before replacing a worker."""
    drain_timeout_s: float = 30.0
    """A worker removed on purpose (scale-down, a node drained) is told to finish its leases and leave; after this
    long it is killed (its leases are re-issued, as for a death)."""
    weights: Literal["auto", "zmq", "shm"] = "auto"
    """Which weight path each worker takes. ``auto``: by locality, chosen per worker: a worker on rank 0's node
    reads shared memory from a node relay there, every other worker takes ``zmq`` from the trainer (as deltas per ``delta``);
    ``zmq``: every worker from the trainer over zmq; ``shm``: only for a fleet entirely on rank 0's node."""
    delta: Literal["auto"] | bool = "auto"
    """Whether workers that take ``zmq`` get each version as a delta against the one they hold (``weights.delta``:
    fewer bytes on the wire, more CPU at both ends), chosen per worker. ``auto``: only workers whose node address
    differs from rank 0's (a network between them); a worker or relay on rank 0's address (its own node, or fake
    nodes on one host) takes full versions, which cost a memory copy there. ``true``/``false``: every zmq worker."""
    poll_s: float = 0.5
    """How often the supervisor looks at the cluster's nodes (joins, removals) besides the actors' deaths."""
    place_timeout_s: float = 60.0
    """A worker actor not running on its node this long after it was asked for (the node's resources are held by
    something else, the node is going away) is given up: killed, and tried again there after the backoff. The
    supervisor goes on watching everything else meanwhile."""

    def __post_init__(self):
        if self.min_workers < 0 or self.workers_per_node < 1:
            raise ValueError(f"cluster.fleet: {self.min_workers=} must be >= 0 and {self.workers_per_node=} >= 1")
        if self.max_workers is not None and self.max_workers < max(1, self.min_workers):
            raise ValueError(f"cluster.fleet.max_workers={self.max_workers} must be >= max(1, min_workers="
                             f"{self.min_workers}), or None for as many as the nodes hold")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ValueError(f"cluster.fleet: need 0 <= {self.restart_backoff_s=} <= {self.restart_backoff_max_s=}")
        if not self.place_timeout_s > 0:
            raise ValueError(f"cluster.fleet.place_timeout_s={self.place_timeout_s} must be > 0")
        if self.weights not in ("auto", "zmq", "shm"):
            raise ValueError(f"cluster.fleet.weights={self.weights!r} must be 'auto', 'zmq' or 'shm'")
        if self.delta not in ("auto", True, False):
            raise ValueError(f"cluster.fleet.delta={self.delta!r} must be 'auto', true or false")


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    """The ``sbatch`` script ``asyncrl launch --engine slurm`` renders: trainer hosts run ``srun torchrun``, rollout
    hosts run ``asyncrl worker --registry`` against the pools' records on shared storage."""

    job_name: str = "asyncrl"
    """``#SBATCH --job-name``."""
    partition: str | None = None
    """``#SBATCH --partition``; None: the cluster's default."""
    account: str | None = None
    """``#SBATCH --account``; None: none."""
    time: str = "24:00:00"
    """``#SBATCH --time``."""
    rollout_nodes: int = 1
    """Nodes of the allocation that run rollout workers (after the trainer's ``cluster.trainer.nnodes``)."""
    gpus_per_node: int = 8
    """``#SBATCH --gpus-per-node``; 0: no GPU request."""
    rdzv_port: int = 29500
    """The torchrun rendezvous port on the first trainer host."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run first on every host (``module load ...``, ``source .venv/bin/activate``)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More ``#SBATCH`` options, e.g. ``--exclusive`` or ``--mem=0``."""

    def __post_init__(self):
        if self.rollout_nodes < 0 or self.gpus_per_node < 0:
            raise ValueError(f"cluster.slurm: {self.rollout_nodes=} and {self.gpus_per_node=} must be >= 0")


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Which engine starts the run's processes, and where it puts them (``asyncrl launch``)."""

    engine: Literal["local", "ray", "slurm"] = "local"
    """``local``: ``torchrun`` on this machine (the recipe's own path, unchanged); ``ray``: a Ray cluster places the
    trainer gang and the rollout fleet; ``slurm``: an ``sbatch`` script (``asyncrl launch --dry-run`` prints it)."""
    address: str = "auto"
    """``ray``: the cluster to join (``ray.init(address=...)``): ``auto`` (a cluster started on this node) or the
    head's ``HOST:PORT``."""
    namespace: str = "asyncrl"
    """``ray``: the Ray namespace of the run's named actors (the registry is ``asyncrl-registry-<run name>``)."""
    node_ip: str | None = None
    """The address every pool and weight channel binds on a node; None: that node's address as Ray reports it.
    Tests pin it to ``127.0.0.1``."""
    trainer: GangConfig = field(default_factory=GangConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self):
        if self.engine not in ("local", "ray", "slurm"):
            raise ValueError(f"cluster.engine={self.engine!r} must be 'local', 'ray' or 'slurm'")

"""The Ray engine's driver: the trainer gang, the rollout fleet, and what happens when either loses a process.

::

    launch(cfg)                         ray.init(cluster.address); the registry actor; the pools' key pair
      RaySupervisor.run()               one loop: ray.wait on every actor's run ref, at most cluster.fleet.poll_s
        _start_gang()                   placement group (one bundle per rank) -> ranks by node IP -> rank 0's IP
                                        and a free port -> each rank's recipe with torchrun's variables -> records
        _reconcile()                    the fleet: each alive node with rollout resources gets its workers; an actor
                                        asked for is watched like the others (its info ref in the same ray.wait) and
                                        authorized in every pool's allow-list once it runs, before its worker starts
        a worker's ref ends             revoke its key in every pool (refused from then on); replace it after a
                                        backoff if its node is alive
        a rank's ref ends non-zero      the gang is torn down, the fleet stopped, the gang started again
                                        (--resume: the newest complete checkpoint), at most trainer.max_restarts
        every rank ends 0               the run is over: the workers got SHUTDOWN from their pools

Everything that happens is one line of ``RUN_DIR/cluster/events.jsonl`` (``gang_started``, ``worker_started``,
``worker_died``, ``key_revoked``, ``node_added``, ``node_removed``, ``gang_failed``, ...), with the time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import yaml
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from asyncrl.cluster.placement import (PlacedBundle, assign_ranks, backoff_s, fleet_floor, fleet_target,
                                       free_resources, gang_bundles, node_capacity, torchrun_env, wants_delta,
                                       weight_path, worker_resources)
from asyncrl.codec import dumps_json
from asyncrl.config import RecipeConfig, apply_overrides
from asyncrl.integrations.ray.actors import RegistryActor, RolloutWorkerActor, TrainerRankActor
from asyncrl.transport.zmq import generate_curve_keys

__all__ = ["JOIN_WAIT_S", "RaySupervisor", "launch", "registry_name", "relay_prefix"]

logger = logging.getLogger(__name__)


JOIN_WAIT_S = 30.0
"""How long one parked ``wait_pending`` call waits in the registry before it returns (empty) and is made again."""


def relay_prefix(run_dir: str) -> str:
    """Where the relays of a run's gangs serve on rank 0's node: ``<prefix>.<attempt>`` under ``/dev/shm``, named by a
    hash of the run directory (two runs never share one, a run's attempts are found by it)."""
    root = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    return f"{root}/asyncrl-relay-{hashlib.sha1(run_dir.encode()).hexdigest()[:12]}"


def registry_name(run_dir: str) -> str:
    """The registry actor's name for a run: ``asyncrl-registry-<run directory's name>``."""
    return f"asyncrl-registry-{Path(run_dir).resolve().name}"


@dataclass
class _Worker:
    worker_id: str
    node_id: str
    actor: Any
    public_key: str
    ref: Any = None
    draining: bool = False
    weights: str = "zmq"
    delta: bool = False
    """Whether it takes its zmq versions as deltas (:func:`~asyncrl.cluster.placement.wants_delta`)."""


@dataclass
class _Placing:
    """A worker actor asked for and not yet running (:meth:`RaySupervisor._start_worker`)."""

    worker_id: str
    node_id: str
    actor: Any
    info: Any
    """Its ``info()`` ref: ready once the actor runs on its node."""
    deadline: float


@dataclass
class _Gang:
    pg: Any
    ranks: list[Any]
    refs: list[Any]
    slots: list[Any]
    records: list[dict[str, Any]] | None = None
    done: set[int] = field(default_factory=set)
    relay: str | None = None
    """The shm directory of the weight relay on rank 0's node (``cluster.fleet.weights: auto``)."""


class RaySupervisor:
    """Runs one launch of a run on a connected Ray cluster (``ray.init`` done by the caller)."""

    def __init__(self, cfg: RecipeConfig, tree: dict[str, Any], *, recipe: str, pythonpath: list[str]):
        self.cfg, self.tree, self.recipe, self.pythonpath = cfg, tree, str(Path(recipe).resolve()), pythonpath
        self.cluster, self.gang_cfg, self.fleet_cfg = cfg.cluster, cfg.cluster.trainer, cfg.cluster.fleet
        self.run_dir = str(Path(cfg.run_dir).resolve())
        self.logs = Path(self.run_dir) / "cluster" / "logs"
        self.events_path = Path(self.run_dir) / "cluster" / "events.jsonl"
        self.events_path.parent.mkdir(parents=True, exist_ok=True)
        self.pool_public, self.pool_secret = generate_curve_keys()
        self.keys: dict[str, str] = {}  # worker id -> public key, authorized in every pool
        self.workers: dict[str, _Worker] = {}
        self.placing: dict[str, _Placing] = {}  # worker id -> an actor asked for, not running yet
        self.deaths: dict[str, int] = {}  # node id -> worker deaths in a row there
        self.next_start: dict[str, float] = {}  # node id -> no new worker there before this time
        self.nodes: dict[str, dict[str, Any]] = {}  # alive nodes last seen
        self.gang: _Gang | None = None
        self.restarts = 0
        self.attempt = 0
        self.serial = 0
        self.stopping = False
        try:  # a registry left by an earlier launch of this run (its driver killed): replaced
            ray.kill(ray.get_actor(registry_name(self.run_dir)), no_restart=True)
        except ValueError:
            pass
        self._stop_requested = threading.Event()
        self.cordoned: set[str] = set()
        """Nodes drained on purpose (:meth:`drain_node`): no worker is placed there any more."""
        self._below_min: bool | None = None
        self._join_ref: Any = None
        """A ``wait_pending`` call parked in the registry: ready when a worker outside Ray asks to join."""
        self.registry = self._new_registry()
        self._next_scan = 0.0

    # -- the registry --------------------------------------------------------------------------------------------
    def _new_registry(self) -> Any:
        """The run's named registry, on the driver's own node: it lives and dies with the driver, never with a
        worker node that is removed."""
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        return RegistryActor.options(name=registry_name(self.run_dir), num_cpus=0, scheduling_strategy=here,
                                     max_concurrency=8).remote()

    def _registry(self, method: str, *args: Any) -> Any:
        """Calls the registry; one that died (its node lost all the same) is made again, with the current records."""
        try:
            return ray.get(getattr(self.registry, method).remote(*args))
        except RayActorError:
            self.event("registry_restarted")
            self.registry = self._new_registry()
            gang = self.gang
            if gang is not None and gang.records is not None and method != "put_records":
                ray.get(self.registry.put_records.remote(gang.records))
            return ray.get(getattr(self.registry, method).remote(*args))

    # -- events --------------------------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        line = {"time": time.time(), "event": kind, **fields}
        logger.info("%s", line)
        with open(self.events_path, "ab") as f:
            f.write(dumps_json(line) + b"\n")

    # -- the gang ------------------------------------------------------------------------------------------------
    def _start_gang(self) -> None:
        gang = self.gang_cfg
        bundles = gang_bundles(gang)
        pg = placement_group(bundles, strategy=gang.strategy)
        try:
            ray.get(pg.ready(), timeout=gang.ready_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"the trainer's placement group ({len(bundles)} bundles of {bundles[0]}, {gang.strategy}) "
                               f"was not placed within cluster.trainer.ready_timeout_s={gang.ready_timeout_s}: the "
                               "cluster lacks those resources (ray status shows what it has)") from None
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        table = placement_group_table(pg)["bundles_to_node_id"]
        slots = assign_ranks([PlacedBundle(int(i), node, ips.get(node, "")) for i, node in table.items()])
        # from here the gang is ours to stop, whatever fails while it starts
        self.gang = _Gang(pg=pg, ranks=[], refs=[], slots=slots)
        self.gang.ranks = ranks = [TrainerRankActor.options(
            num_cpus=gang.cpus_per_rank, num_gpus=gang.gpus_per_rank, resources=dict(gang.resources),
            max_concurrency=4, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=s.bundle_index)).remote(s.rank) for s in slots]
        master = self.cluster.node_ip or slots[0].node_ip
        port = ray.get(ranks[0].free_port.remote(master))
        ray.get([r.set_allow_list.remote(sorted(self.keys.values())) for r in ranks])
        self.attempt += 1
        for slot, actor in zip(slots, ranks):
            ray.get(actor.start.remote(self._rank_tree(slot), torchrun_env(slot, master, port), self.recipe,
                                       str(self.logs / f"rank{slot.rank}.attempt{self.attempt}.log"), self.pythonpath))
            self.gang.refs.append(actor.wait.remote())
        self.event("gang_started", attempt=self.attempt, master=f"{master}:{port}",
                   ranks=[{"rank": s.rank, "node_id": s.node_id, "node_ip": s.node_ip} for s in slots])

    def _rank_tree(self, slot: Any) -> dict[str, Any]:
        host = self.cluster.node_ip or slot.node_ip
        tree = yaml.safe_load(yaml.safe_dump(self.tree))  # a deep copy of plain data
        apply_overrides(tree, ["cluster.engine=ray", "rollout.num_workers=0", f"run_dir={self.run_dir}",
                               f"rollout.min_workers={self.fleet_cfg.min_workers}",  # below it each rank pauses
                               f"rollout.transport.bind=tcp://{host}:0", "weights.type=zmq",
                               f"weights.bind=tcp://{host}:0",
                               # the broadcaster encodes only once some receiver asks for deltas (_worker_sets)
                               f"weights.delta={str(self.fleet_cfg.delta is not False).lower()}"])
        # set, not overridden: Z85 keys hold characters YAML would read as syntax
        tree["rollout"].setdefault("transport", {}).update(curve_public_key=self.pool_public,
                                                           curve_secret_key=self.pool_secret)
        return tree

    def _collect_records(self) -> None:
        """Once every rank wrote its pool's record: into the registry, and the fleet may start."""
        gang = self.gang
        if gang is None or gang.records is not None:
            return
        records = ray.get([r.record.remote(self.run_dir) for r in gang.ranks])
        if all(r is not None for r in records):
            gang.records = records
            self._registry("put_records", records)
            self.event("pools_ready", endpoints=[r["endpoint"] for r in records])
            if self.fleet_cfg.weights in ("auto", "shm"):  # weights by locality: a relay on rank 0's node serves it shm
                rank0 = gang.ranks[0]
                self._authorize("relay", ray.get(rank0.relay_key.remote()))
                ip = gang.slots[0].node_ip  # the relay shares rank 0's host: deltas only when forced
                gang.relay = ray.get(rank0.start_relay.remote(
                    records[0]["weights"]["address"], records[0]["server_key"],
                    f"{relay_prefix(self.run_dir)}.{self.attempt}", wants_delta(self.fleet_cfg.delta, ip, ip)))
                self.event("relay_started", node_id=gang.slots[0].node_id, directory=gang.relay)

    def _stop_gang(self, reason: str) -> None:
        gang, self.gang = self.gang, None
        if gang is None:
            return
        try:
            self._registry("put_records", None)
        except Exception as e:  # deliberate: the gang must be stopped whatever the registry says
            logger.warning("registry: %s: %s", type(e).__name__, e)
        for actor in gang.ranks:  # SIGTERM, then the actor itself (its recipe follows it: asyncrl.lifeline)
            try:
                ray.get(actor.stop.remote(5.0), timeout=15)
            except Exception:  # deliberate: the actor may be dead already; ray.kill below is what must happen
                pass
            ray.kill(actor, no_restart=True)
        remove_placement_group(gang.pg)
        self._revoke("relay")
        self.event("gang_stopped", reason=reason)

    # -- the fleet -----------------------------------------------------------------------------------------------
    def _alive_nodes(self) -> dict[str, dict[str, Any]]:
        return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}

    def _scan_nodes(self) -> None:
        alive = self._alive_nodes()
        for node in alive.keys() - self.nodes.keys():
            if self.nodes:  # not the first look
                self.event("node_added", node_id=node, capacity=node_capacity(alive[node]["Resources"], self.fleet_cfg))
        for node in self.nodes.keys() - alive.keys():
            self.event("node_removed", node_id=node)
        self.nodes = alive

    def _reconcile(self) -> None:
        """Each alive node gets the workers its resources and ``max_workers`` allow; extra ones drain."""
        gang = self.gang
        if gang is None or gang.records is None or self.stopping:
            return
        bundle = gang_bundles(self.gang_cfg)[0]  # what each trainer rank holds on its node
        live = sum(not w.draining for w in self.workers.values())
        self._below_min, floor_event = fleet_floor(self._below_min, live, self.fleet_cfg.min_workers)
        if floor_event is not None:
            self.event(floor_event, workers=live, min_workers=self.fleet_cfg.min_workers)
        capacity = {n: 0 if n in self.cordoned else node_capacity(
            free_resources(info["Resources"], [bundle for s in gang.slots if s.node_id == n]), self.fleet_cfg)
            for n, info in self.nodes.items()}
        target = fleet_target(capacity, self.fleet_cfg)
        now = time.monotonic()
        for node, want in target.items():
            have = [w for w in self.workers.values() if w.node_id == node and not w.draining]
            asked = sum(p.node_id == node for p in self.placing.values())
            if len(have) + asked < want and now >= self.next_start.get(node, 0.0):
                self._start_worker(node)
                return  # one at a time: the next loop iteration places the next
            for extra in have[want:]:
                self._drain(extra, "node_drained" if node in self.cordoned else "scale_down")

    def _start_worker(self, node: str) -> None:
        """Asks Ray for a worker actor on ``node`` and returns at once; :meth:`_placed` starts it once it runs."""
        fleet, gang = self.fleet_cfg, self.gang
        assert gang is not None and gang.records is not None
        self.serial += 1
        worker_id = f"ray-{node[:8]}-{self.serial}"
        need = worker_resources(fleet)
        actor = RolloutWorkerActor.options(
            num_cpus=need.get("CPU", 0), num_gpus=need.get("GPU", 0),
            resources={k: v for k, v in need.items() if k not in ("CPU", "GPU")}, max_concurrency=2,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(worker_id)
        self.placing[worker_id] = _Placing(worker_id, node, actor, actor.info.remote(),
                                           time.monotonic() + fleet.place_timeout_s)

    def _placed(self, placing: _Placing) -> None:
        """The actor runs (its info ref is ready) or could not be placed: the worker starts, or the node backs off."""
        del self.placing[placing.worker_id]
        gang, node, worker_id = self.gang, placing.node_id, placing.worker_id
        try:
            info = ray.get(placing.info, timeout=0)
        except (RayActorError, GetTimeoutError) as e:  # the node went away, or it cannot hold the actor now
            ray.kill(placing.actor, no_restart=True)
            self.next_start[node] = time.monotonic() + self.fleet_cfg.restart_backoff_s
            self.event("worker_not_placed", worker_id=worker_id, node_id=node, error=f"{type(e).__name__}: {e}"[:300])
            return
        if gang is None or gang.records is None or self.stopping or node in self.cordoned:
            ray.kill(placing.actor, no_restart=True)  # placed too late: the gang or the node is going
            return
        self._authorize(worker_id, info["public_key"])  # before it connects: its first handshake is admitted
        ip = self.nodes.get(node, {}).get("NodeManagerAddress", "")
        worker = _Worker(worker_id=worker_id, node_id=node, actor=placing.actor, public_key=info["public_key"],
                         weights=weight_path(node, gang.slots[0].node_id, self.fleet_cfg.weights),
                         delta=wants_delta(self.fleet_cfg.delta, ip, gang.slots[0].node_ip))
        worker.ref = placing.actor.run.remote(gang.records, self._worker_sets(worker),
                                              str(self.logs / f"{worker_id}.log"))
        self.workers[worker_id] = worker
        self.event("worker_started", worker_id=worker_id, node_id=node, pid=info["pid"], weights=worker.weights,
                   delta=worker.delta)

    def _check_placing(self) -> None:
        """Gives up the actors not running by their deadline (:data:`FleetConfig.place_timeout_s`)."""
        now = time.monotonic()
        for placing in [p for p in self.placing.values() if now >= p.deadline]:
            self._placed(placing)  # its info ref is not ready: a GetTimeoutError, handled as not placed

    def _worker_sets(self, worker: _Worker) -> list[str]:
        """The worker's weight path, chosen for it: on rank 0's node the relay's shared memory (the broadcaster's zmq
        stays its fallback while the relay is down); elsewhere zmq straight from the broadcaster, as deltas when a
        network lies between them (:func:`~asyncrl.cluster.placement.wants_delta`)."""
        gang = self.gang
        assert gang is not None
        sets = [f"worker.weights.delta={str(worker.delta).lower()}"]
        if worker.weights == "shm" and gang.relay is not None:
            sets.append(f"worker.weights.relay={gang.relay}")
        return sets

    def _authorize(self, worker_id: str, key: str) -> None:
        self.keys[worker_id] = key
        self._push_allow_list()
        self.event("key_authorized", worker_id=worker_id)

    def _revoke(self, worker_id: str) -> None:
        if self.keys.pop(worker_id, None) is not None:
            self._push_allow_list()
            self.event("key_revoked", worker_id=worker_id)

    def _push_allow_list(self) -> None:
        if self.gang is not None:
            keys = sorted(self.keys.values())
            ray.get([r.set_allow_list.remote(keys) for r in self.gang.ranks])

    def _drain(self, worker: _Worker, reason: str) -> None:
        worker.draining = True
        self.event("worker_draining", worker_id=worker.worker_id, reason=reason)
        worker.actor.drain.remote(self.fleet_cfg.drain_timeout_s)

    def _worker_ended(self, worker: _Worker) -> None:
        try:
            code = ray.get(worker.ref)
            died, detail = False, f"exit {code}"
        except RayActorError as e:  # ActorDiedError: killed, its node removed, out of memory
            died, detail = True, f"{type(e).__name__}"
        del self.workers[worker.worker_id]
        self._revoke(worker.worker_id)  # refused from now on, whatever it still sends
        ray.kill(worker.actor, no_restart=True)  # its process ended: the actor's resources go back to the node
        if worker.draining or self.stopping:
            self.event("worker_left", worker_id=worker.worker_id, detail=detail)
            return
        deaths = self.deaths.get(worker.node_id, 0) + 1
        self.deaths[worker.node_id] = deaths
        wait = backoff_s(deaths, self.fleet_cfg.restart_backoff_s, self.fleet_cfg.restart_backoff_max_s)
        self.next_start[worker.node_id] = time.monotonic() + wait
        self.event("worker_died" if died else "worker_exited", worker_id=worker.worker_id, node_id=worker.node_id,
                   detail=detail, replace_in_s=wait)

    def _stop_fleet(self, reason: str) -> None:
        for placing in list(self.placing.values()):
            ray.kill(placing.actor, no_restart=True)
        self.placing.clear()
        for worker in list(self.workers.values()):
            worker.draining = True
            ray.kill(worker.actor, no_restart=True)
            self._revoke(worker.worker_id)
            self.event("worker_left", worker_id=worker.worker_id, detail=reason)
        self.workers.clear()

    # -- external workers ----------------------------------------------------------------------------------------
    def _join_wait(self) -> Any:
        """The parked ``wait_pending`` call (made again once it returned)."""
        if self._join_ref is None:
            self._join_ref = self.registry.wait_pending.remote(JOIN_WAIT_S)
        return self._join_ref

    def _joiners(self) -> None:
        """The parked call returned: authorize whoever asked to join (a dead registry is made again, and asked)."""
        ref, self._join_ref = self._join_ref, None
        try:
            pending = ray.get(ref)
        except RayActorError:
            pending = self._registry("pending")
        for worker_id, key in pending.items():
            self._authorize(f"external:{worker_id}", key)
            self._registry("mark_authorized", worker_id)

    # -- the loop ------------------------------------------------------------------------------------------------
    def _gang_ended(self, index: int) -> bool:
        """A rank's run ref is ready; True when the gang failed (a rank died or exited non-zero)."""
        gang = self.gang
        assert gang is not None
        try:
            code = ray.get(gang.refs[index])
        except RayActorError as e:
            self.event("gang_failed", rank=gang.slots[index].rank, detail=type(e).__name__)
            return True
        if code != 0:
            self.event("gang_failed", rank=gang.slots[index].rank, detail=f"exit {code}")
            return True
        gang.done.add(index)
        return False

    def drain_node(self, node_id: str) -> None:
        """Takes a node out of the fleet on purpose (before maintenance, a scale-down): its workers drain (finish or
        hand back their leases, say BYE) and none is placed there again. Any thread; acted on within ``poll_s``."""
        self.cordoned.add(node_id)

    def request_stop(self) -> None:
        """Ends :meth:`run` at its next look (within ``poll_s``): the fleet and the gang are stopped, and it returns
        130 (an interrupted launch)."""
        self._stop_requested.set()

    def run(self) -> int:
        """Supervises the run until the trainer ends; returns its exit status (0, 1 after ``max_restarts``, 130 on
        :meth:`request_stop`). On an error of its own, everything it started is stopped before it propagates."""
        try:
            return self._run()
        except BaseException:
            self.close()
            raise

    def _run(self) -> int:
        self._scan_nodes()
        self._start_gang()
        poll = self.fleet_cfg.poll_s
        while True:
            if self._stop_requested.is_set():
                self.stopping = True
                self._stop_fleet("stop_requested")
                self._stop_gang("stop_requested")
                self.event("run_stopped")
                return 130
            gang = self.gang
            assert gang is not None
            pending = [r for i, r in enumerate(gang.refs) if i not in gang.done]
            worker_refs = {w.ref: w for w in self.workers.values()}
            placing_refs = {p.info: p for p in self.placing.values()}
            join = self._join_wait()
            ready, _ = ray.wait([*pending, *worker_refs, *placing_refs, join], num_returns=1, timeout=poll)
            failed = False
            for ref in ready:
                if ref in worker_refs:
                    self._worker_ended(worker_refs[ref])
                elif ref in placing_refs:
                    self._placed(placing_refs[ref])
                elif ref == join:
                    self._joiners()
                else:
                    failed = self._gang_ended(gang.refs.index(ref)) or failed
            if failed:
                self.stopping = True
                self._stop_fleet("gang_restart")
                self._stop_gang("a rank failed")
                self.restarts += 1
                if self.restarts > self.gang_cfg.max_restarts:
                    self.event("run_failed", restarts=self.restarts - 1)
                    return 1
                time.sleep(self.gang_cfg.restart_backoff_s)
                self.stopping = False
                self._start_gang()
                self.event("gang_restarted", restart=self.restarts)
                continue
            if len(gang.done) == len(gang.refs):
                self.stopping = True
                self.event("run_finished")
                deadline = time.monotonic() + self.fleet_cfg.drain_timeout_s
                while self.workers and time.monotonic() < deadline:  # their pools said SHUTDOWN: they exit 0
                    ready, _ = ray.wait([w.ref for w in self.workers.values()], num_returns=1, timeout=1.0)
                    for ref in ready:
                        self._worker_ended(next(w for w in self.workers.values() if w.ref == ref))
                self._stop_fleet("run_finished")
                self._stop_gang("run_finished")
                return 0
            if time.monotonic() >= self._next_scan:
                self._next_scan = time.monotonic() + poll
                self._scan_nodes()
                self._collect_records()
                self._check_placing()
                self._reconcile()

    def close(self) -> None:
        """Stops whatever still runs (an interrupted launch, an error); each step on its own, so one failing (an actor
        already gone) does not keep the others from running."""
        self.stopping = True
        for step in (lambda: self._stop_fleet("closed"), lambda: self._stop_gang("closed"),
                     lambda: ray.kill(self.registry, no_restart=True)):
            try:
                step()
            except Exception as e:  # deliberate: the error that brought us here is the one to report
                logger.warning("while closing the Ray run: %s: %s", type(e).__name__, e)


def run_tree(run_file: str | None, overrides: list[str]) -> dict[str, Any]:
    tree = yaml.safe_load(Path(run_file).read_text()) if run_file else {}
    return apply_overrides(tree or {}, overrides)


def launch(cfg: RecipeConfig, *, run_file: str | None, overrides: list[str], recipe: str, dry_run: bool = False) -> int:
    """``asyncrl launch --engine ray``."""
    if dry_run:
        print(f"ray: join {cfg.cluster.address!r}, namespace {cfg.cluster.namespace!r}")
        print(f"trainer: placement group of {cfg.cluster.trainer.world_size} bundles {gang_bundles(cfg.cluster.trainer)[0]}"
              f" ({cfg.cluster.trainer.strategy}), max_restarts={cfg.cluster.trainer.max_restarts}")
        print(f"fleet: {worker_resources(cfg.cluster.fleet)} per worker, {cfg.cluster.fleet.workers_per_node} per node, "
              f"min {cfg.cluster.fleet.min_workers}, max {cfg.cluster.fleet.max_workers}")
        return 0
    if not ray.is_initialized():
        ray.init(address=cfg.cluster.address, namespace=cfg.cluster.namespace, log_to_driver=False)
    pythonpath = [os.getcwd(), *([str(Path(run_file).resolve().parent)] if run_file else [])]
    supervisor = RaySupervisor(cfg, run_tree(run_file, overrides), recipe=recipe, pythonpath=pythonpath)
    try:
        return supervisor.run()  # stops what it started if it fails
    finally:
        if supervisor.gang is None and not supervisor.workers:
            try:
                ray.kill(supervisor.registry, no_restart=True)
            except Exception:  # deliberate: already gone with a closing cluster
                pass
        print(f"events: {supervisor.events_path}", file=sys.stderr)

"""Ray as the cluster engine, on a Ray cluster of fake nodes on this machine (``ray.cluster_utils.Cluster``), every
byte on loopback. One cluster for the module; one run of the recipe in which everything happens in turn, checked at
the end from the run's own records:

- placement: the two trainer ranks on the two trainer nodes (a gloo gang across them), a worker on every node with the
  rollout resource;
- a rollout actor killed (``ray.kill``) mid-run: detected, its key revoked, replaced after a backoff; the fleet is
  below ``min_workers`` (3) meanwhile and the ranks pause, then resume;
- a node removed (``cluster.remove_node``) and a node added: the ranks pause below the floor and resume when a worker
  starts on the new node, authenticates, syncs weights and contributes groups;
- a worker started outside Ray (``asyncrl worker --ray-address``) joins through the registry and contributes;
- the new node drained on purpose: its worker leaves cleanly (BYE, exit 0) and nothing is placed there again;
- a trainer rank killed: the gang restarts from the newest checkpoint (``cluster.trainer.max_restarts``); the worker
  outside Ray finds the restarted gang's pools in the registry and serves them (the fleet needs it to reach the floor);
- every prompt of every epoch trained exactly once across all of it, within the staleness bound; nothing of the run
  listens beyond loopback;

and, apart, ``asyncrl launch --engine ray`` killed mid-run leaves no rank training.

Ray's own daemons (GCS, raylets, its core workers) bind every interface in Ray 2.60 whatever the node IP, and so does
torch.distributed's rendezvous store on rank 0 (``MASTER_PORT``: ``TCPStore`` takes no bind address; the same under
plain torchrun); the loopback check covers every other socket of asyncrl's processes (the ranks' recipes and the
workers): the pools, the weight channel, gloo's own connections. The cluster's
node IP is pinned to 127.0.0.1 (:mod:`asyncrl.integrations.ray.fake`).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from asyncrl.config import load_config  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "asyncrl-test"
NUM_PROMPTS, BATCH, WORLD, EPOCHS = 32, 2, 2, 4
STEPS = EPOCHS * NUM_PROMPTS // (BATCH * WORLD)  # four whole epochs: every event in turn fits, with margin under load


@pytest.fixture(scope="module")
def cluster():
    from asyncrl.integrations.ray.fake import fake_cluster, node_args

    with fake_cluster({"a": node_args(2, 2, asyncrl_trainer=1, asyncrl_rollout=1),
                       "b": node_args(2, 2, asyncrl_trainer=1, asyncrl_rollout=1),
                       "c": node_args(1, 1, asyncrl_rollout=1)}, namespace=NAMESPACE) as (c, nodes):
        yield c, nodes


def _node_id(node) -> str:
    return node.node_id


def test_actors_land_on_the_nodes_their_resources_say(cluster):
    c, nodes = cluster

    @ray.remote(num_cpus=0)
    class Where:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    trainer = [Where.options(resources={"asyncrl_trainer": 1}).remote() for _ in range(2)]
    rollout_only = Where.options(resources={"asyncrl_rollout": 1}, num_gpus=1,
                                 scheduling_strategy="SPREAD").remote()
    try:
        placed = ray.get([a.node.remote() for a in trainer], timeout=60)
        assert set(placed) == {_node_id(nodes["a"]), _node_id(nodes["b"])}
        assert ray.get(rollout_only.node.remote(), timeout=60) in {_node_id(n) for n in nodes.values()}
    finally:
        for a in [*trainer, rollout_only]:
            ray.kill(a)


def _overrides(run_dir: Path) -> list[str]:
    """The smallest real run: the tiny model, HF workers, four epochs of 32 prompts over 2 ranks, a checkpoint every
    2 steps."""
    return [
        f"run_dir={run_dir}", f"train.steps={STEPS}", "train.sft_steps=0", "train.threads=1", "checkpoint.every=2",
        "checkpoint.keep=2", f"data.num_prompts={NUM_PROMPTS}", "rollout.group_size=2", f"rollout.batch_size={BATCH}",
        "rollout.capacity=8", "rollout.worker.slots=2", "rollout.worker.max_batch=2", "rollout.wait_timeout_s=180",
        "rollout.transport.heartbeat_s=0.5", "rollout.transport.peer_timeout_s=5", "debug.report=false",
        "cluster.engine=ray", "cluster.node_ip=127.0.0.1", f"cluster.namespace={NAMESPACE}",
        "cluster.trainer.nnodes=2", "cluster.trainer.max_restarts=1", "cluster.trainer.restart_backoff_s=0.5",
        "cluster.fleet.min_workers=3", "cluster.fleet.restart_backoff_s=0.5", "cluster.fleet.poll_s=0.3",
        "cluster.fleet.drain_timeout_s=10", "testing.step_delay_s=1.0"]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait(cond, timeout_s: float, what: str, check=None):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _descendants(roots: set[int]) -> set[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = set(), set(roots)
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def _listeners(pids: set[int]) -> list[str]:
    text = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in text.splitlines() if any(f"pid={p}," in line for p in pids)]


def test_a_ray_run_survives_kills_node_changes_and_a_rank_restart(cluster, tmp_path):
    from asyncrl.integrations.ray.fake import node_args
    from asyncrl.integrations.ray.supervisor import RaySupervisor, registry_name, run_tree

    c, nodes = cluster
    run_dir = tmp_path / "run"
    run_file = str(ROOT / "recipes/configs/tiny_cpu.yaml")
    cfg = load_config(run_file, _overrides(run_dir))
    sup = RaySupervisor(cfg, run_tree(run_file, _overrides(run_dir)), recipe=str(ROOT / "recipes/grpo.py"),
                        pythonpath=[str(ROOT)])
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_run(sup)), daemon=True)
    t0 = time.monotonic()
    thread.start()
    events = lambda: _read_jsonl(run_dir / "cluster" / "events.jsonl")  # noqa: E731
    steps = lambda: len(_read_jsonl(run_dir / "metrics.jsonl"))  # noqa: E731
    consumed_workers = lambda: {w for r in range(WORLD) for rec in _read_jsonl(run_dir / f"consumed-rank{r}.jsonl")  # noqa: E731
                                for w in rec.get("workers", [])}

    def alive():
        if result:
            raise AssertionError(f"the run ended early ({result}); events: {events()[-8:]}; logs in "
                                 f"{run_dir / 'cluster' / 'logs'}")

    ext = None
    try:
        _wait(lambda: steps() >= 1, 240, "the first step", alive)
        t_first = time.monotonic() - t0
        # placement: rank r on a trainer node, a worker on each rollout node
        gang = next(e for e in events() if e["event"] == "gang_started")
        assert {r["node_id"] for r in gang["ranks"]} == {_node_id(nodes["a"]), _node_id(nodes["b"])}
        _wait(lambda: {w.node_id for w in sup.workers.values()} >= {_node_id(n) for n in nodes.values()}, 60,
              "a worker on every rollout node", alive)
        # weights by locality: shm through the relay on rank 0's node, zmq from the trainer elsewhere
        rank0_node = gang["ranks"][0]["node_id"]
        assert any(e["event"] == "relay_started" and e["node_id"] == rank0_node for e in events())
        paths = {e["node_id"]: e["weights"] for e in events() if e["event"] == "worker_started"}
        assert paths[rank0_node] == "shm" and {p for n, p in paths.items() if n != rank0_node} == {"zmq"}, paths
        # every fake node is on 127.0.0.1, rank 0's address: full versions, no deltas (cluster.fleet.delta: auto)
        assert not any(e["delta"] for e in events() if e["event"] == "worker_started")
        # nothing of the run (the recipes, the workers) listens beyond loopback
        actor_pids = {p for e in events() if e["event"] == "worker_started" for p in [e["pid"]]}
        actor_pids |= {ray.get(r.node.remote())["pid"] for r in sup.gang.ranks}
        mine = _descendants(actor_pids)
        assert mine, "no process under the actors"
        master_port = gang["master"].rsplit(":", 1)[1]
        listening = [a for a in _listeners(mine) if a.rsplit(":", 1)[1] != master_port]
        assert listening and all(addr.startswith("127.0.0.1:") for addr in listening), listening

        # 1. a rollout actor killed mid-run: replaced after its key is revoked; the ranks pause below min_workers (3)
        # meanwhile and resume once the replacement serves (each rank logs its pauses; rank 0's log is read here)
        rank0_log = run_dir / "cluster" / "logs" / "rank0.attempt1.log"
        said = lambda what: rank0_log.read_text().count(what) if rank0_log.exists() else 0  # noqa: E731
        _wait(lambda: said("resumed after") >= 1, 60, "the ranks resumed once the first fleet served", alive)
        victim = next(w for w in sup.workers.values() if w.node_id == _node_id(nodes["a"]))
        ray.kill(victim.actor)
        _wait(lambda: any(e["event"] == "key_revoked" and e["worker_id"] == victim.worker_id for e in events()), 30,
              "the victim's key revoked", alive)
        _wait(lambda: any(e["event"] == "worker_started" and e["node_id"] == _node_id(nodes["a"])
                          and e["worker_id"] != victim.worker_id for e in events()), 30, "a replacement on a", alive)
        _wait(lambda: said("paused: ") >= 2 and said("resumed after") >= 2, 60, "a pause and a resume after the kill",
              alive)

        # 2. a node removed: the ranks pause below the floor; a node added: a worker starts there, contributes, and
        # the ranks resume
        c.remove_node(nodes.pop("c"))
        _wait(lambda: any(e["event"] == "node_removed" for e in events()), 30, "the node's removal seen", alive)
        _wait(lambda: said("paused: ") >= 3, 60, "the ranks paused after the node's removal", alive)
        t_add = time.monotonic()
        nodes["d"] = c.add_node(**node_args(1, 1, asyncrl_rollout=1))
        d_id = _node_id(nodes["d"])
        _wait(lambda: any(e["event"] == "worker_started" and e["node_id"] == d_id for e in events()), 60,
              "a worker on the new node", alive)
        d_worker = next(e["worker_id"] for e in events() if e["event"] == "worker_started" and e["node_id"] == d_id)
        _wait(lambda: d_worker in consumed_workers(), 120, "a group from the new node trained", alive)
        add_to_group_s = time.monotonic() - t_add
        assert said("resumed after") >= 3

        # 3. a worker outside Ray joins through the registry
        key = tmp_path / "ext.key"
        from asyncrl.transport.zmq import write_curve_key_file

        write_curve_key_file(str(key))
        ext = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "worker", "--ray-address", c.address,
                                "--run-name", run_dir.name, "--ray-namespace", NAMESPACE, "--client-key-file", str(key),
                                "--worker-id", "outside-1", "--registry-timeout-s", "60"],
                               stdout=open(tmp_path / "ext.log", "wb"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        _wait(lambda: "outside-1" in consumed_workers(), 120, "a group from the worker outside Ray", alive)
        assert registry_name(str(run_dir)) == f"asyncrl-registry-{run_dir.name}"

        # 4. the new node drained on purpose: its worker finishes, says BYE and leaves (exit 0), none replaces it
        sup.drain_node(d_id)
        _wait(lambda: any(e["event"] == "worker_left" and e["worker_id"] == d_worker for e in events()), 60,
              "the drained worker gone", alive)
        left = next(e for e in events() if e["event"] == "worker_left" and e["worker_id"] == d_worker)
        assert left["detail"] == "exit 0", left

        # 5. a trainer rank killed: the gang restarts from the newest checkpoint
        _wait(lambda: (run_dir / "checkpoints" / "latest").exists(), 120, "a checkpoint", alive)
        killed_at = steps()
        os.kill(int((run_dir / "pid-rank1").read_text()), signal.SIGKILL)
        # the restarted gang has two supervised workers (c removed, d drained): it trains only once the worker
        # outside Ray has found its pools through the registry
        _wait(lambda: any("outside-1" in rec.get("workers", []) and rec["step"] > killed_at
                          for r in range(WORLD) for rec in _read_jsonl(run_dir / f"consumed-rank{r}.jsonl")), 180,
              "the worker outside Ray serving the restarted gang", alive)
        thread.join(300)
        assert not thread.is_alive(), "the run did not end"
    finally:
        if ext is not None and ext.poll() is None:
            ext.kill()
            ext.wait()
        if thread.is_alive():
            sup.close()
            thread.join(30)
    assert result == [0], (result, events()[-10:])
    assert killed_at < STEPS, "the rank was killed after the last step: the run was too quick for the test"
    ev = collections.Counter(e["event"] for e in events())
    assert ev["gang_failed"] == 1 and ev["gang_restarted"] == 1 and ev["gang_started"] == 2, ev
    # the killed actor is a death; the removed node's worker is one too, or an exit, whichever Ray reports first
    assert ev["worker_died"] >= 1 and ev["worker_died"] + ev["worker_exited"] >= 2, ev
    assert ev["node_added"] >= 1 and ev["node_removed"] >= 1, ev
    # below min_workers the ranks paused (at the start, after the kill, after the removal), then resumed
    assert ev["fleet_below_min"] >= 2 and ev["fleet_restored"] >= 2, ev  # the kill, the removal
    before_restart = [m for m in metrics_of(run_dir) if m["step"] <= killed_at]
    pauses = max(m["pipeline"]["fleet_pauses"] for m in before_restart)
    assert pauses >= 3 and max(m["pipeline"]["fleet_paused_s"] for m in before_restart) > 0, pauses
    assert ev["worker_draining"] == 1 and not any(e["event"] == "worker_started" and e["node_id"] == d_id
                                                  and e["worker_id"] != d_worker for e in events())
    # every prompt of the epoch trained exactly once, across the kills, the node changes and the restart
    consumed = [g for r in range(WORLD) for rec in _read_jsonl(run_dir / f"consumed-rank{r}.jsonl")
                for g in rec["group_ids"]]
    counts = collections.Counter(consumed)
    assert sorted(counts) == sorted(f"e{e}-p{i}" for e in range(EPOCHS) for i in range(NUM_PROMPTS)), sorted(counts)
    assert max(counts.values()) == 1, [g for g, n in counts.items() if n > 1]
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert max(m["staleness_max"] for m in metrics) <= cfg.rollout.max_staleness
    trained_by = collections.Counter(e["node_id"] for e in events() if e["event"] == "worker_started"
                                     and e["worker_id"] in consumed_workers())
    assert trained_by[rank0_node] >= 1 and len(trained_by) >= 3, trained_by  # shm and zmq workers both trained
    # the shm workers took their versions from the relay (no byte from the broadcaster), the others over zmq
    path_of = {e["worker_id"]: e["weights"] for e in events() if e["event"] == "worker_started"}
    zmq_bytes: dict[str, int] = collections.defaultdict(int)
    versions: dict[str, int] = collections.defaultdict(int)
    for m in metrics:
        for w, st in m["pipeline"]["workers"].items():
            zmq_bytes[w] = max(zmq_bytes[w], st.get("weight_full_bytes", 0) + st.get("weight_delta_bytes", 0))
            versions[w] = max(versions[w], st.get("policy_version", 0))
    shm = [w for w in zmq_bytes if path_of.get(w) == "shm" and versions[w] >= 1]
    over_zmq = [w for w in zmq_bytes if path_of.get(w) == "zmq" and versions[w] >= 1]
    assert shm and all(zmq_bytes[w] == 0 for w in shm), {w: zmq_bytes[w] for w in shm}
    assert over_zmq and all(zmq_bytes[w] > 0 for w in over_zmq), {w: zmq_bytes[w] for w in over_zmq}
    from asyncrl.integrations.ray.supervisor import relay_prefix

    assert not glob.glob(relay_prefix(str(run_dir.resolve())) + ".*"), "a relay's shared memory was left behind"
    # the actors' private directories (the pools' key pair in a rank's run file, a worker's key pair): removed by
    # actors that ended, swept (owner lock free) from those Ray killed whenever a later actor made its own
    from asyncrl.integrations.ray.actors import RANK_DIR_PREFIX, WORKER_DIR_PREFIX

    tmp = tempfile.gettempdir()
    left = [p for prefix in (RANK_DIR_PREFIX, WORKER_DIR_PREFIX) for p in glob.glob(os.path.join(tmp, f"{prefix}*"))]
    assert not left, left
    print(f"\nray run: rank killed at step {killed_at} of {STEPS}; first step after {t_first:.1f} s; "
          f"add_node -> first group from it trained {add_to_group_s:.1f} s;"
          f" events {dict(ev)}")


def metrics_of(run_dir: Path) -> list[dict]:
    return _read_jsonl(run_dir / "metrics.jsonl")


def _run(sup) -> int:
    try:
        return sup.run()
    except BaseException as e:  # the test thread reports it
        return e


def test_a_worker_that_cannot_be_placed_does_not_hold_up_the_supervisor(cluster, tmp_path):
    """A node whose rollout GPU is held by something else: the worker actor asked for there stays pending. The
    supervisor does not wait on it (everything else is still watched); after ``place_timeout_s`` it gives it up,
    says ``worker_not_placed`` and backs off before asking there again."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from asyncrl.integrations.ray.supervisor import RaySupervisor, _Gang, run_tree

    c, nodes = cluster
    node = _node_id(next(n for name, n in nodes.items() if name not in ("a", "b")))  # the rollout-only node

    @ray.remote(num_cpus=0)
    class Hold:
        def ready(self):
            return True

    holder = Hold.options(num_gpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    run_dir = tmp_path / "run"
    run_file = str(ROOT / "recipes/configs/tiny_cpu.yaml")
    overrides = [*_overrides(run_dir), "cluster.fleet.place_timeout_s=2"]
    sup = RaySupervisor(load_config(run_file, overrides), run_tree(run_file, overrides),
                        recipe=str(ROOT / "recipes/grpo.py"), pythonpath=[str(ROOT)])
    try:
        assert ray.get(holder.ready.remote(), timeout=60)
        sup.gang = _Gang(pg=None, ranks=[], refs=[], slots=[], records=[{"rank": 0}])  # a gang whose pools are up
        t0 = time.monotonic()
        sup._start_worker(node)
        assert time.monotonic() - t0 < 5 and len(sup.placing) == 1  # asked for, not waited on
        placing = next(iter(sup.placing.values()))
        ready, _ = ray.wait([placing.info], timeout=1.0)
        assert not ready  # pending: the node's GPU is held
        time.sleep(2.2)
        sup._check_placing()
        assert not sup.placing and not sup.workers
        gave_up = [e for e in _read_jsonl(run_dir / "cluster" / "events.jsonl") if e["event"] == "worker_not_placed"]
        assert len(gave_up) == 1 and gave_up[0]["node_id"] == node, gave_up
        assert sup.next_start[node] > time.monotonic()  # backs off before asking there again
    finally:
        sup.gang = None
        sup.close()
        ray.kill(holder)


def test_a_killed_launcher_leaves_no_rank_training(cluster, tmp_path):
    """``asyncrl launch --engine ray`` SIGKILLed mid-run: Ray ends the actors it owned and each rank's recipe exits with
    its actor (asyncrl.lifeline): one trainer per run holds on a cluster too."""
    c, _ = cluster
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "launch", "--config", str(ROOT / "recipes/configs/tiny_cpu.yaml"),
         "--recipe", str(ROOT / "recipes/grpo.py"), *_overrides(run_dir), f"cluster.address={c.address}",
         "train.steps=1000", "testing.step_delay_s=0.2"],
        stdout=open(tmp_path / "launch.log", "wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _wait(lambda: len(_read_jsonl(run_dir / "metrics.jsonl")) >= 1, 180, "the first step",
              lambda: launcher.poll() is None or pytest.fail((tmp_path / "launch.log").read_text()[-3000:]))
        pids = [int((run_dir / f"pid-rank{r}").read_text()) for r in range(WORLD)]
        launcher.kill()
        launcher.wait()
        _wait(lambda: not any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids), 60,
              "every rank gone after its launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        return "zombie"


def test_launch_dry_run_prints_the_ray_plan(capsys):
    from asyncrl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["launch", "--config", str(ROOT / "recipes/configs/tiny_cpu.yaml"), "--engine", "ray", "--dry-run",
              "cluster.trainer.nnodes=2", "cluster.trainer.ranks_per_node=4", "cluster.fleet.max_workers=6"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "placement group of 8 bundles" in out and "max 6" in out, out

"""The ``asyncrl`` command line.

``asyncrl worker --connect ADDR [--connect ADDR ...]`` runs one rollout worker serving the pools at
those addresses (one per trainer rank), e.g. on another machine. Worker settings come from
``--config FILE.json`` (``{"worker": {...}, "transport": {...}}``) and dotted overrides such as
``--set worker.slots=8 --set worker.engine.max_new_tokens=256`` (values are YAML, as in a recipe's overrides:
:func:`asyncrl.config.apply_overrides`).

``asyncrl relay --connect ADDR --serve-shm DIR`` runs a node's weight relay (one per rollout node): it fetches each
weight version once from the broadcaster at ``ADDR``, verifies it and re-serves it in shared memory under ``DIR`` to
the workers of that node (``--set worker.weights.relay=DIR``); it is replaced when it dies (``--no-supervise``: not).

The debugger's commands (``asyncrl <command> --help`` for each):

- ``asyncrl replay DUMP --checkpoint CKPT``: recompute a dumped batch token by token (asyncrl.debug.replay).
- ``asyncrl align --model DIR [--engine hf|vllm]``: rollout vs trainer logprobs gate (asyncrl.debug.align).
- ``asyncrl report RUN_DIR``: a self-contained HTML report of a run (asyncrl.debug.report).
- ``asyncrl check --model DIR [--engine hf|vllm]``: every link from a model directory to RL training, verified
  stage by stage (asyncrl.check.runner).

``asyncrl launch --config RUN.yaml [--engine local|ray|slurm] [--dry-run] [KEY=VALUE ...]`` starts a run of the recipe:
``torchrun`` on this machine, the trainer gang and rollout fleet on a Ray cluster, or a Slurm job
(:mod:`asyncrl.cluster.launch`, :mod:`asyncrl.integrations.ray`). ``asyncrl worker --registry RUN_DIR`` (or
``--ray-address ADDR --run-name NAME``) finds every rank's pool, its public key and the worker settings from the
pools' records instead of typed endpoints (:mod:`asyncrl.cluster.registry`).

``asyncrl tiny-model DIR [--chat | --vlm]`` builds a tiny model directory locally (asyncrl.testing.build): a 2-layer
Qwen2 with a character tokenizer, or with a BPE tokenizer and a chat template, or a tiny vision-language model.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from asyncrl.codec import loads_json
from asyncrl.config import HFEngineConfig, TransportConfig, WorkerConfig, apply_overrides, from_dict

__all__ = ["main"]


def _worker(args: argparse.Namespace) -> None:
    # SIGTERM drains: the worker leaves as on SHUTDOWN, saying BYE (its pools re-issue its leases at once) after
    # flushing the groups it finished (a launcher removing a worker on purpose: asyncrl.integrations.ray)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    if args.parent_pid is not None:  # before the heavy imports: a worker starting up must not outlive its parent
        from asyncrl.lifeline import die_with_parent

        die_with_parent(args.parent_pid, what=f"rollout worker {args.worker_id or ''}".strip())

    from asyncrl.transport import PeerLost

    device = None
    if args.device:  # before any engine touches CUDA: this process sees only its GPUs
        from workers.launcher import pin_device

        device = pin_device(args.device)
    from workers.worker import run_worker

    found = bool(args.registry or args.ray_address)  # the pools found through their records, not typed
    lost: str | None = None  # the incarnation of the pools this worker lost (found through a registry)
    while True:
        tree: dict[str, Any] = {"worker": {}, "transport": {}}
        connect, server_key = list(args.connect or []), args.server_key
        if found:  # every rank's endpoint, the pools' public key and the run's worker settings
            records = _pool_records(args, not_incarnation=lost)
            connect, server_key = [r["endpoint"] for r in records], server_key or records[0]["server_key"]
            tree = {"worker": records[0]["worker"], "transport": records[0]["transport"]}
        if args.config:
            with open(args.config, "rb") as f:
                tree.update(loads_json(f.read()))
        if args.config_json:
            tree.update(loads_json(args.config_json))
        apply_overrides(tree, args.set or [])
        if args.client_key_file:  # this worker's CURVE secret key: its public key is in the pool's allow-list
            tree.setdefault("transport", {})["curve_client_key_file"] = args.client_key_file
        worker = from_dict(WorkerConfig, tree.get("worker", {}), "worker.")  # errors name the dotted key
        if device is not None and isinstance(worker.engine, HFEngineConfig):  # vLLM uses the GPUs it sees
            worker = dataclasses.replace(worker, engine=dataclasses.replace(worker.engine, device=device))
        transport = from_dict(TransportConfig, tree.get("transport", {}), "transport.")
        args.worker_id = args.worker_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        try:
            run_worker(connect, worker, transport, worker_id=args.worker_id, parent_pid=args.parent_pid,
                       server_key=server_key)
            return
        except PeerLost as e:
            if not found:
                raise
            # the trainer gang went silent (a rank died, the launcher restarts it elsewhere): the registry names the
            # next incarnation's pools; a run that ended for good leaves none, and --registry-timeout-s ends the wait
            lost = records[0]["incarnation"]
            logging.getLogger("asyncrl.cli").warning("%s; waiting up to %.0f s (--registry-timeout-s) for the run's "
                                                     "next trainer in the registry", e, args.registry_timeout_s)


def _pool_records(args: argparse.Namespace, not_incarnation: str | None = None) -> list[dict[str, Any]]:
    """A complete set of the run's pool records, of another incarnation than ``not_incarnation``: from the files under
    ``--registry``, or from the Ray registry actor of ``--run-name`` on the cluster at ``--ray-address``
    (asyncrl.cluster.registry)."""
    if args.registry:
        from asyncrl.cluster.registry import wait_pool_records

        return wait_pool_records(args.registry, timeout_s=args.registry_timeout_s, not_incarnation=not_incarnation)
    if not args.run_name:
        raise SystemExit("asyncrl worker --ray-address needs --run-name (the name of the run directory)")
    if not args.client_key_file or not args.worker_id:
        raise SystemExit("asyncrl worker --ray-address needs --client-key-file (its public key is authorized through the "
                         "registry) and --worker-id")
    import zmq

    from asyncrl.integrations.ray.registry import lookup_records
    from asyncrl.transport.zmq import read_curve_keys_file

    public = zmq.curve_public(read_curve_keys_file(args.client_key_file)[0].encode()).decode()
    return lookup_records(args.ray_address, args.run_name, namespace=args.ray_namespace,
                          timeout_s=args.registry_timeout_s, worker_id=args.worker_id, public_key=public,
                          not_incarnation=not_incarnation)


def _relay(args: argparse.Namespace) -> None:
    tree: dict[str, Any] = {"relay": {}, "transport": {}}
    if args.config:
        with open(args.config, "rb") as f:
            tree.update(loads_json(f.read()))
    relay = tree.setdefault("relay", {})
    relay.update(connect=args.connect, directory=args.serve_shm or args.serve_cuda_ipc,
                 serve="shm" if args.serve_shm else "cuda_ipc")
    if args.device:
        relay["device"] = args.device
    apply_overrides(tree, args.set or [])
    if args.client_key_file:  # this relay's CURVE secret key: its public key is in the broadcaster's allow-list
        tree.setdefault("transport", {})["curve_client_key_file"] = args.client_key_file
    from asyncrl.config import RelayConfig
    from workers.relay import RelayLauncher, run_relay

    cfg, transport = from_dict(RelayConfig, tree["relay"]), from_dict(TransportConfig, tree.get("transport", {}))
    relay_id = args.relay_id or f"relay-{os.uname().nodename}"
    if args.no_supervise:
        sys.exit(run_relay(cfg, transport, relay_id=relay_id, server_key=args.server_key))
    sys.exit(RelayLauncher(cfg, transport, relay_id=relay_id, server_key=args.server_key).run())


def _launch(args: argparse.Namespace) -> None:
    from asyncrl.cluster.launch import default_recipe, run_local, run_slurm
    from asyncrl.config import load_config

    overrides = list(args.overrides) + ([f"cluster.engine={args.engine}"] if args.engine else [])
    cfg = load_config(args.config, overrides)  # refused here, naming the key, before anything starts
    recipe = args.recipe or default_recipe()
    if cfg.cluster.engine == "local":
        sys.exit(run_local(cfg, args.config, overrides, recipe=recipe, resume=args.resume, dry_run=args.dry_run))
    if cfg.cluster.engine == "slurm":
        sys.exit(run_slurm(cfg, args.config, overrides, recipe=recipe, python=args.python, dry_run=args.dry_run))
    try:
        from asyncrl.integrations.ray import launch_ray
    except ImportError as e:
        raise SystemExit(f"cluster.engine=ray needs Ray: pip install 'asyncrl[ray]' ({e})") from None
    sys.exit(launch_ray(cfg, run_file=args.config, overrides=overrides, recipe=recipe, dry_run=args.dry_run))


_TOOLS = {
    "replay": ("asyncrl.debug.replay", "recompute a dumped batch and say token by token where rollout and trainer disagree"),
    "align": ("asyncrl.debug.align", "rollout-side vs trainer-side logprobs on the same tokens; non-zero exit above a threshold"),
    "report": ("asyncrl.debug.report", "write a self-contained HTML report (and PNGs) of a run directory"),
    "check": ("asyncrl.check.runner", "verify a model directory stage by stage for RL: structure, split, checkpoint, "
              "weight sync, logprobs, loss; non-zero exit on any failure"),
    "tiny-model": ("asyncrl.testing.build", ("build a tiny model directory locally to try things with (--chat: a BPE "
                                             "tokenizer and a chat template; --vlm: a vision-language model)")),
}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _TOOLS:  # each tool owns its arguments (and its --help)
        import importlib

        sys.exit(importlib.import_module(_TOOLS[argv[0]][0]).main(argv[1:]))
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="run a rollout worker that serves one or more trainer ranks")
    w.add_argument("--connect", action="append", help="pool endpoint (repeat once per trainer rank)")
    w.add_argument("--registry", metavar="RUN_DIR", help="instead of --connect: read every rank's endpoint, the pools' "
                   "public key and the run's worker settings from the pools' records under RUN_DIR/cluster/pools "
                   "(a run launched by asyncrl launch; shared storage); --set still overrides")
    w.add_argument("--ray-address", help="instead of --connect: ask the run's registry actor on this Ray cluster "
                   "(auto, or HOST:PORT) for the records (with --run-name)")
    w.add_argument("--run-name", help="--ray-address: the run whose registry to ask (its run directory's name)")
    w.add_argument("--ray-namespace", default="asyncrl", help="--ray-address: the run's Ray namespace (cluster.namespace)")
    w.add_argument("--registry-timeout-s", type=float, default=300.0,
                   help="wait this long for every rank's record (at start, and for the next incarnation's once the "
                   "pools went silent: a restarted trainer gang)")
    w.add_argument("--config", help="JSON file with 'worker' and 'transport' sections")
    w.add_argument("--config-json", help=argparse.SUPPRESS)
    w.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, e.g. worker.slots=8")
    w.add_argument("--worker-id", help="unique worker name (default: host-pid-random)")
    w.add_argument("--server-key", help="the pools' CURVE public key (Z85) when they use CURVE")
    w.add_argument("--client-key-file", help="this worker's CURVE secret key file (transport.curve_client_key_file)")
    w.add_argument("--device", help="run on this device: cuda:N (or cuda:N,M for tensor parallel) pins the worker "
                   "to those GPUs (CUDA_VISIBLE_DEVICES); the local launcher passes worker.devices[slot]")
    w.add_argument("--parent-pid", type=int, help="exit as soon as this process is gone (the local launcher's pid)")
    w.add_argument("--log-level", default=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"))
    w.set_defaults(func=_worker)
    r = sub.add_parser("relay", help="run this node's weight relay: each version fetched once, re-served to the "
                       "node's workers")
    r.add_argument("--connect", required=True, help="the weight broadcaster's endpoint (the trainer's weights.address, "
                   "weights.type=zmq)")
    serve = r.add_mutually_exclusive_group(required=True)
    serve.add_argument("--serve-shm", metavar="DIR", help="serve in shared memory under DIR (e.g. /dev/shm/asyncrl-"
                       "relay); the node's workers set worker.weights.relay=DIR")
    serve.add_argument("--serve-cuda-ipc", metavar="DIR", help="serve GPU workers from CUDA IPC slots on --device; DIR "
                       "is the node's relay directory (worker.weights.relay=DIR)")
    r.add_argument("--device", help="--serve-cuda-ipc: the GPU holding the slots (cuda:N)")
    r.add_argument("--config", help="JSON file with 'relay' and 'transport' sections")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, e.g. relay.delta=true")
    r.add_argument("--relay-id", help="the relay's name at the broadcaster (default: relay-<host>)")
    r.add_argument("--server-key", help="the broadcaster's CURVE public key (Z85) when it uses CURVE")
    r.add_argument("--client-key-file", help="this relay's CURVE secret key file (its public key must be in the "
                   "broadcaster's allow-list)")
    r.add_argument("--no-supervise", action="store_true", help="run the relay in this process, not replaced when it "
                   "dies (under a supervisor of your own: systemd, Ray)")
    r.add_argument("--log-level", default=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"))
    r.set_defaults(func=_relay)
    la = sub.add_parser("launch", help="start a run of the recipe: torchrun here (local), on a Ray cluster (ray), or "
                        "as a Slurm job (slurm)")
    la.add_argument("--config", help="the run file (recipes/configs/*.yaml)")
    la.add_argument("--engine", choices=("local", "ray", "slurm"), help="overrides cluster.engine")
    la.add_argument("--dry-run", action="store_true", help="print what would run (the torchrun command, the sbatch "
                    "script, the Ray plan) and start nothing")
    la.add_argument("--recipe", help="the recipe script (default: recipes/grpo.py of this checkout)")
    la.add_argument("--resume", action="store_true", help="local: continue from the run's latest checkpoint (ray and "
                    "slurm always resume when a checkpoint exists)")
    la.add_argument("--python", default="python", help="slurm: the interpreter on the hosts")
    la.add_argument("--log-level", default=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"))
    la.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of the run file")
    la.set_defaults(func=_launch)
    for name, (_, help_text) in _TOOLS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    if args.command == "worker" and not (args.connect or args.registry or args.ray_address):
        w.error("one of --connect ADDR (once per trainer rank), --registry RUN_DIR or --ray-address ADDR (with "
                "--run-name NAME) is required")  # a usage error: exit 2, as argparse's own
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args.func(args)


if __name__ == "__main__":
    main()

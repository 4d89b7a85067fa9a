"""The ranks of the ``checkpoint`` stage (private): tasks run in order by every rank of one launch.

    python -m asyncrl.check._checkpoint_ranks SPEC.json     (under launch_ranks or torchrun: env:// rendezvous)

Each task builds a fresh policy (:func:`asyncrl.check._policy.build_policy`), wraps it with
:func:`asyncrl.train.parallel.parallelize` and gives it the recipe's optimizer (AdamW over the trainable parameters),
a real :class:`~asyncrl.RolloutLoader` (no local workers: its pool and ledger, nothing generating) and a
:class:`~asyncrl.checkpoint.Checkpointer`:

* ``save``: one optimizer step on a fixed batch (so AdamW's ``exp_avg``/``exp_avg_sq``/``step`` are not
  trivial), policy version 3 to the loader, an RNG state of this rank's own, then ``Checkpointer.save``;
* ``load`` (``full``: the same world size): ``Checkpointer.load`` (model, optimizer, RNG, loader, step, version)
  after scrambling the RNG; otherwise (another world size) ``Checkpointer.load_model`` (DCP reshards the model
  and optimizer; the library keeps RNG and loader state per rank and refuses them at another world size).

After each task every rank records, in ``{task}-rank{r}.json``: a digest of every parameter and buffer and of
every optimizer state tensor (full tensors: gathers, collectives in the same order on every rank), the
optimizer's hyperparameters, its RNG state's digest and its loader's state (flattened: after a save, the loader's
``state_dict()``; after a load, the state the Checkpointer handed to the fresh loader's ``load_state_dict``, which
the loader replays on its next ``iter``, a step that needs workers delivering). Who blocks on what:
every rank waits in the Checkpointer's barriers and DCP's collectives and in each gather.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.check._policy import build_policy, digest, fixed_batch, full, full_tensors, import_all
from asyncrl.codec import dumps_json, loads_json

LR = 1e-3
PROMPTS = [{"prompt_ids": [1, 2 + i % 5, 3]} for i in range(16)]
"""The loader's dataset: its ledger shards these over the ranks (nothing is generated)."""
POLICY_VERSION = 3


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """A nested state (dicts, lists, tensors, scalars) as ``path -> text`` (tensors by digest), for comparison."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix: digest(obj) if isinstance(obj, torch.Tensor) else repr(obj)}
    out: dict[str, str] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out or {prefix: repr(obj)}


def optimizer_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """``optim.state.<fqn>.<key>`` -> digest of the full tensor, ``optim.param_groups.<i>`` -> hyperparameters."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, osd = get_state_dict(model, optimizer)
    out: dict[str, str] = {}
    for fqn in sorted(osd["state"]):
        for key, value in sorted(osd["state"][fqn].items()):
            out[f"optim.state.{fqn}.{key}"] = digest(full(value)) if isinstance(value, torch.Tensor) else repr(value)
    for i, group in enumerate(osd["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        out[f"optim.param_groups.{i}"] = json.dumps(hyper, sort_keys=True, default=repr)
    return out


def _trainer(spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    import asyncrl.train.parallel  # looked up at call time: a --import module may wrap it
    from asyncrl import LoaderConfig, RolloutLoader

    policy = build_policy(spec["model"], dtype=spec["dtype"], lora_rank=spec["lora_rank"], seed=spec["seed"])
    model = asyncrl.train.parallel.parallelize(policy, spec["parallel"], torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = RolloutLoader(PROMPTS, LoaderConfig(group_size=2, batch_size=2, num_workers=0, seed=spec["seed"]))
    return model, optimizer, loader


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: dict[str, Any]) -> None:
    from asyncrl.train.logprobs import token_logprobs

    batch = fixed_batch(**spec["batch"])
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], grad=True)
    (-logp.sum() / batch["attention_mask"].sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _task(task: dict[str, Any], spec: dict[str, Any], rank: int) -> dict[str, Any]:
    from asyncrl.checkpoint.checkpointer import Checkpointer

    model, optimizer, loader = _trainer(spec)
    try:
        ckpt = Checkpointer(task["root"], model, optimizer, loader)
        record: dict[str, Any] = {"task": task["name"], "rank": rank, "world": dist.get_world_size()}
        if task["kind"] == "save":
            _step(model, optimizer, spec)
            loader.set_policy_version(POLICY_VERSION)
            torch.manual_seed(spec["seed"] + 1000 + rank)
            torch.rand(7)  # this rank's RNG state, somewhere other than a fresh seed's
            path = ckpt.save(1, POLICY_VERSION, extra={"check": "checkpoint"})
            record["path"] = None if path is None else str(path)
        else:
            torch.manual_seed(spec["seed"] + 5000 + rank)  # another RNG state: the load must bring the saved one
            path = ckpt.resolve()
            if path is None:
                raise FileNotFoundError(f"no complete checkpoint in {task['root']}")
            record["path"] = str(path)
            received: list[dict[str, Any]] = []  # what the Checkpointer hands the loader (replayed on its next iter)
            restore = loader.load_state_dict
            loader.load_state_dict = lambda state: (received.append(state), restore(state))[1]
            if task["full"]:
                state = ckpt.load(path)
                record["trainer"] = {"step": state.step, "policy_version": state.policy_version, "extra": state.extra}
            else:
                ckpt.load_model(path)
        record["tensors"] = {name: digest(t) for name, t in full_tensors(model)}
        record["optim"] = optimizer_digests(model, optimizer)
        record["rng"] = digest(torch.get_rng_state())
        if task["kind"] == "save":
            record["loader"] = flatten(loader.state_dict())
        else:  # a restored loader applies its state when iterated, which needs workers: compare what it was given
            record["loader"] = flatten(received[-1]) if received else {}
        return record
    finally:
        loader.close()


def main(spec_path: str) -> None:
    spec = loads_json(Path(spec_path).read_bytes())
    import_all(spec["imports"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(spec["out"])
    for task in spec["tasks"]:
        record = _task(task, spec, rank)
        (out / f"{task['name']}-rank{rank}.json").write_bytes(dumps_json(record))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

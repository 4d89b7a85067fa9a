"""One rank of the ``parallel`` stage (private): launched by :func:`asyncrl.check._ranks.launch_ranks`.

    python -m asyncrl.check._parallel_ranks SPEC.json       (under launch_ranks or torchrun: env:// rendezvous)

Every rank builds the policy exactly as the single process did (:func:`asyncrl.check._policy.build_policy`),
wraps it with the library's :func:`asyncrl.train.parallel.parallelize` (DDP or FSDP2), then:

1. gathers every parameter and buffer (``full_tensor()``: collectives, in module order on every rank) and
   digests its bytes; rank 0 keeps the tensors whose digest differs from the single process's
   (``mismatch.safetensors``, at most ``worst``) so the stage can say by how much and where;
2. runs the forward on the spec's fixed batch and measures ``max |logits - single process|`` and
   ``max |logits - rank 0's|`` (rank 0's logits are broadcast).

It writes ``rank{r}.json`` into the spec's ``out`` directory. Who blocks on what: every rank waits in each gather
and in the broadcast for all the others; the launcher ends them all if one dies.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.check._policy import build_policy, digest, fixed_batch, full_tensors, import_all
from asyncrl.codec import dumps_json, loads_json


def main(spec_path: str) -> None:
    from safetensors.torch import load_file, save_file

    spec = loads_json(Path(spec_path).read_bytes())
    import_all(spec["imports"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import asyncrl.train.parallel  # looked up at call time: a --import module may wrap it

    out = Path(spec["out"])
    policy = build_policy(spec["model"], dtype=spec["dtype"], lora_rank=spec["lora_rank"], seed=spec["seed"])
    model = asyncrl.train.parallel.parallelize(policy, spec["parallel"], torch.device("cpu"))
    expected: dict[str, str] = spec["digests"]
    digests, keep = {}, {}
    for name, t in full_tensors(model):
        digests[name] = digest(t)
        if rank == 0 and digests[name] != expected.get(name) and len(keep) < spec["worst"]:
            keep[name] = t.detach().clone().contiguous()
    if keep:
        save_file(keep, str(out / "mismatch.safetensors"))
    batch = fixed_batch(**spec["batch"])
    reference = load_file(spec["logits"])["logits"]
    from asyncrl.train.logprobs import position_ids

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=position_ids(batch["attention_mask"])).logits.float()
    real = batch["attention_mask"].bool()[..., None]
    zero = torch.zeros((), dtype=logits.dtype)
    first = logits.clone()
    dist.broadcast(first, src=0)
    report = {
        "rank": rank, "world": world, "digests": digests,
        "logits_max_abs": float(torch.where(real, (logits - reference).abs(), zero).max()),
        "logits_vs_rank0": float(torch.where(real, (logits - first).abs(), zero).max()),
    }
    (out / f"rank{rank}.json").write_bytes(dumps_json(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

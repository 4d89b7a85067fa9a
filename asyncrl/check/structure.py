"""Stage ``structure``: every trainer tensor accounted for at the engine and vice versa, by name, shape, dtype and tie.

    trainer (this process): the published state's names, shapes, dtypes (HF names, ``policy_state(model)``), and
                            which parameters share storage (tied embeddings: ``lm_head.weight`` = ``embed_tokens``)
    engine process:         its own parameters (``Engine`` built as a worker builds it, before any update):
                            HF: the module's state dict; vLLM: the model runner's parameters (packed CPU weights
                            read back), fused ``qkv_proj`` / ``gate_up_proj``, tied ``lm_head`` = ``embed_tokens``

The name mapping is the one post-sync verification uses (:func:`workers.engines._vllm_ext.engine_param`: q/k/v
into ``qkv_proj`` shards 0/1/2 of the model config's head counts, gate/up into ``gate_up_proj``), so a mapping
this stage accepts is the one the checksums of ``weight_sync`` read. Offenders: a trainer tensor with no engine
tensor (``missing at the engine``), an engine tensor no trainer tensor maps to (``extra at the engine``; a
fused one lists its uncovered shards), shapes or dtypes that differ, and ties present on one side only.
With ``--lora`` the base model is checked (the adapter's names are the peft ones on both sides:
``weight_sync`` checks them tensor by tensor); with ``--qlora`` the 4-bit base on both sides (packed weights and
their quantization state tensors included).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from asyncrl.check import CheckContext, StageResult

__all__ = ["run", "trainer_structure"]


def trainer_structure(model: torch.nn.Module) -> dict[str, Any]:
    """``{"params": {name: [shape, dtype]}, "tied": [[names sharing storage]]}`` of the published full state."""
    from asyncrl.weights.state import policy_state

    specs = policy_state(model, "full").specs
    params = {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in specs.items()}
    by_storage: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_storage.setdefault(p.data_ptr(), []).append(name)
    return {"params": params, "tied": sorted(sorted(v) for v in by_storage.values() if len(v) > 1)}


def _compare_hf(trainer: dict[str, Any], engine: dict[str, Any]) -> tuple[list[dict], dict[str, str]]:
    ours, theirs = trainer["params"], engine["params"]
    offenders = [{"name": n, "what": "missing at the engine", "shape": ours[n][0]} for n in sorted(set(ours) - set(theirs))]
    offenders += [{"name": n, "what": "extra at the engine", "shape": theirs[n][0]} for n in sorted(set(theirs) - set(ours))]
    for n in sorted(set(ours) & set(theirs)):
        if ours[n][0] != theirs[n][0]:
            offenders.append({"name": n, "what": "shape differs", "trainer": ours[n][0], "engine": theirs[n][0]})
        elif ours[n][1] != theirs[n][1]:
            offenders.append({"name": n, "what": "dtype differs", "trainer": ours[n][1], "engine": theirs[n][1]})
    return offenders, {n: n for n in ours if n in theirs}


def _compare_vllm(trainer: dict[str, Any], engine: dict[str, Any]) -> tuple[list[dict], dict[str, str]]:
    from workers.engines._vllm_ext import engine_param

    ours, theirs, sizes = trainer["params"], engine["params"], engine["fused_slices"]
    tied = engine["tie_word_embeddings"]
    offenders, mapping, covered = [], {}, {}
    for name, (shape, dtype) in ours.items():
        module_path, fused, index = engine_param(name, tied)
        key = f"{module_path}.{name.rpartition('.')[2]}"
        if key not in theirs:
            offenders.append({"name": name, "what": "missing at the engine", "engine_name": key, "shape": shape})
            continue
        held_shape, held_dtype = theirs[key]
        want = list(held_shape)
        if fused is not None:
            want[0] = sizes[fused][index] if len(want) else want
            if held_shape and held_shape[0] != sum(sizes[fused]):
                offenders.append({"name": key, "what": f"fused rows {held_shape[0]} != shards {sizes[fused]}"})
        if list(shape) != want:
            offenders.append({"name": name, "what": "shape differs", "engine_name": key, "trainer": shape,
                              "engine": want})
        elif dtype != held_dtype:
            offenders.append({"name": name, "what": "dtype differs", "engine_name": key, "trainer": dtype,
                              "engine": held_dtype})
        mapping[name] = key if fused is None else f"{key}[{fused} shard {index}]"
        covered.setdefault(key, set()).add(index)
    for group in engine["tied"]:  # one storage under several names (vLLM's tied lm_head): covered together
        if shared := [covered[n] for n in group if n in covered]:
            for n in group:
                covered.setdefault(n, set()).update(*shared)
    for key, (shape, _) in sorted(theirs.items()):
        module_path = key.rpartition(".")[0]
        fused = module_path.rpartition(".")[2]
        need = set(range(len(sizes[fused]))) if fused in sizes else {None}
        if key not in covered:
            offenders.append({"name": key, "what": "extra at the engine (no trainer tensor maps to it)", "shape": shape})
        elif missing := need - covered[key]:
            offenders.append({"name": key, "what": f"shards {sorted(missing)} of {fused} not covered by the trainer"})
    return offenders, mapping


def _ties(trainer: dict[str, Any], engine: dict[str, Any]) -> list[dict[str, Any]]:
    ours = {frozenset(t) for t in trainer["tied"]}
    theirs = {frozenset(t) for t in engine["tied"]}
    out = [{"name": " = ".join(sorted(t)), "what": "tied in the trainer, separate at the engine"} for t in ours - theirs]
    out += [{"name": " = ".join(sorted(t)), "what": "tied at the engine, separate in the trainer"} for t in theirs - ours]
    return out


def run(ctx: CheckContext) -> StageResult:
    from asyncrl.check._chain import Chain, load_trainer_policy, shared_chain

    t0 = time.perf_counter()
    base = dataclasses.replace(ctx, lora_rank=0)  # with --qlora: the 4-bit base, as the engine holds it
    trainer = trainer_structure(load_trainer_policy(base))
    if ctx.lora_rank and ctx.engine == "vllm":  # vLLM's LoRA layers rename the base: the base alone, on its own
        with Chain(base, "structure") as chain:
            engine = chain.engine.specs()
    else:  # the run's engine, before any update (structure runs first)
        engine = shared_chain(ctx).engine.specs()
    offenders, mapping = (_compare_vllm if engine.get("fused") else _compare_hf)(trainer, engine)
    offenders += _ties(trainer, engine)
    fused = sum("shard" in v for v in mapping.values())
    summary = (f"{len(trainer['params'])} trainer tensors -> {len(engine['params'])} engine tensors "
               f"({fused} into fused projections), ties {trainer['tied'] or 'none'}: {len(offenders)} problems")
    metrics = {"trainer_tensors": len(trainer["params"]), "engine_tensors": len(engine["params"]),
               "mapping": mapping, "trainer_tied": trainer["tied"], "engine_tied": engine["tied"],
               "problems": len(offenders)}
    return StageResult(stage="structure", ok=not offenders, summary=summary, offenders=offenders[: ctx.worst],
                       metrics=metrics, seconds=time.perf_counter() - t0)

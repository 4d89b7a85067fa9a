"""Rejected updates: the batch the update guard refused, dumped for inspection, and replayed from a checkpoint.

``write_rejected_batch`` writes ``{run_dir}/dumps/step-N-rank{r}.msgpack`` (kind ``rejected_batch``: the
batch's tensors, rewards, ids, finish reasons, reward components, the guard's reason and numbers) when a step
is rejected with the debugger off (with it on, the rejection is one of its anomalies and it dumps).
``replay_rejection`` recomputes such a batch's loss and the guard's non-finite check from the checkpoint of the
step before, in this process: ``asyncrl replay`` separates system bugs from instabilities in more depth.
Nobody blocks on anything here but the caller, on its own file I/O and forward/backward.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from asyncrl.checkpoint.checkpointer import MODEL as CHECKPOINT_MODEL
from asyncrl.debug.dump import write_dump
from asyncrl.train.guard import GuardVerdict
from asyncrl.train.logprobs import token_logprobs
from asyncrl.train.losses import compute_loss
from asyncrl.train.reference import ReferencePolicy

__all__ = ["replay_rejection", "write_rejected_batch"]


def write_rejected_batch(run_dir: str | os.PathLike, *, step: int, rank: int, policy_version: int,
                         verdict: GuardVerdict, batch: dict[str, Any], rewards: torch.Tensor) -> Path:
    """Dumps the batch of a rejected step (with the rewards it was trained on) and says where, on stderr."""
    body = {
        "step": step,
        "rank": rank,
        "policy_version": policy_version,
        "reason": verdict.reason,
        "loss": verdict.loss,
        "grad_norm": verdict.grad_norm,
        "update_ratio": verdict.update_ratio,
        "batch": {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)} | {"rewards": rewards},
        "uids": batch["uids"],
        "group_ids": batch["group_ids"],
        "finish_reasons": batch["finish_reasons"],
        "reward_components": batch.get("reward_components", {}),  # per reward function (asyncrl.rewards.reward_set)
    **{k: batch[k] for k in ("images", "image_sha256") if k in batch},  # image prompts: bytes + hashes
    }
    path = write_dump(Path(run_dir) / "dumps" / f"step-{step:06d}-rank{rank}.msgpack", "rejected_batch", body)
    print(f"[rank {rank}] step {step}: update rejected ({verdict.reason}); batch dumped to {path}", file=sys.stderr)
    return path


def replay_rejection(dump_path: str | os.PathLike, checkpoint: str | os.PathLike, cfg: Any,
                     model_dir: str) -> str:
    """Recomputes a dumped batch's loss and guard decision with the weights of ``checkpoint`` (the step
    before the rejection), in this process, without a process group. ``cfg`` is the run's config (the
    recipe's ``RecipeConfig``: ``model``, ``rollout.worker.engine``, ``loss``, ``train``, ``lora``, ``run_dir``).
    Returns the guard's reason, or "" if the update would now be accepted."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from asyncrl.debug.dump import read_dump

    kind, body = read_dump(dump_path)
    if kind not in ("rejected_batch", "anomaly_batch"):
        raise ValueError(f"{dump_path} holds a {kind!r}, not a rejected batch")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.model.dtype))
    state = {CHECKPOINT_MODEL: model.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint))
    model.load_state_dict(state[CHECKPOINT_MODEL])
    b = {k: v.clone() for k, v in body["batch"].items()}
    engine = cfg.rollout.worker.engine
    logp = token_logprobs(model, b["input_ids"], b["attention_mask"], temperature=engine.temperature,
                          top_k=engine.top_k, top_p=engine.top_p, grad=True)
    b |= {"finish_reasons": body.get("finish_reasons", ["stop"] * len(b["rewards"])),
          "reward_components": body.get("reward_components", {})}
    ref = None
    if cfg.loss.beta > 0:  # the run's reference: the model directory, or the warmed policy it saved
        warmed = Path(cfg.run_dir) / "model-ref"
        ref = ReferencePolicy.load(warmed if cfg.train.sft_steps and not cfg.lora.rank else model_dir,
                                   dtype=cfg.model.dtype).logprobs(b["input_ids"], b["attention_mask"],
                                                                   temperature=engine.temperature, top_k=engine.top_k,
                                                                   top_p=engine.top_p)
    loss_cfg = dataclasses.replace(cfg.loss, max_completion_length=cfg.loss.max_completion_length or engine.max_new_tokens)
    loss, _, _ = compute_loss(b, logp, config=loss_cfg, trainer_version=body["policy_version"], ref_logprobs=ref)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))
    if not math.isfinite(float(loss.detach())) or not math.isfinite(grad_norm):
        return f"non-finite loss={float(loss.detach())} or grad_norm={grad_norm}"
    return ""

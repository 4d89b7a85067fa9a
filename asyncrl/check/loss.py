"""Stage ``loss``: data format and loss. One GRPO step on the engine's own rollouts, collated as training does.

    check process:  policy = build_policy(ctx)                 (the trainer's; LoRA: its adapter)
                    engine = build_engine(engine_config(ctx))   (as a worker builds it), apply_weights(policy)
                    groups = engine.generate(prompts, n)  ──►  collate_groups (the loader's collate)
                    format     every row: prompt + response tokens in place, attention over real tokens only,
                               loss_mask exactly on the generated response tokens, no padding inside a response
                    padding    the batch widened by padding columns, and its pad positions given other tokens:
                               the same loss and the same logprobs at the real tokens
                    positions  one row unpadded, right-padded and left-padded through the trainer's logprobs
                               (asyncrl.train.logprobs.position_ids): positions 0.. at the real tokens, equal logprobs
                    step       batch_logprobs -> compute_loss (the recipe's GRPO loss) -> backward -> AdamW step:
                               loss finite, per-layer gradient norms finite, non-zero, under loss.grad_norm_max

Rewards are the sample index within the group (any non-constant reward gives every row a non-zero advantage: the
stage checks the data path and the loss, not the task). Thresholds: ``loss.pad_max_abs`` (logprobs of a row under
another padding; per-dtype defaults in :mod:`asyncrl.check.thresholds`) and ``loss.grad_norm_max``. Runs in the
check process; blocks in the engine's ``generate``.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import torch

from asyncrl.check import CheckContext, StageResult
from asyncrl.check._policy import begin_stage, build_policy

__all__ = ["run"]

PADS = 3
"""Padding tokens added on either side of a row for the positions check."""
LR = 1e-3
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _limit(ctx: CheckContext, key: str) -> float:
    """``ctx.thresholds[key]``, else the dtype's default (:data:`asyncrl.check.thresholds.DEFAULTS`)."""
    from asyncrl.check.thresholds import DEFAULTS

    return float(ctx.thresholds.get(key, DEFAULTS.get(ctx.dtype, DEFAULTS["bfloat16"])[key]))


def _rollouts(ctx: CheckContext, policy: torch.nn.Module) -> tuple[list[Any], dict[str, Any]]:
    """The engine's groups for the check's prompts, under the trainer's weights (a worker's update path)."""
    from asyncrl.check._chain import check_prompts
    from asyncrl.check._engine import _build, engine_config
    from asyncrl.debug.align import groups_from_completions
    from asyncrl.weights.base import WeightUpdate
    from asyncrl.weights.state import policy_state
    from workers.engines.base import GenerationRequest

    config = engine_config(ctx)
    engine = _build(config, getattr(ctx, "engine_class", None))
    try:
        with policy_state(policy) as state:  # what a publish sends: the full state, or the adapter only
            tensors = {name: state[name].detach().clone() for name in state}
        engine.apply_weights(WeightUpdate(version=1, mode=state.mode, tensors=tensors, lora_config=state.lora_config))
        prompts = check_prompts(ctx)
        requests = [GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=ctx.samples) for i, p in enumerate(prompts)]
        groups = groups_from_completions(engine.generate(requests), worker_id="check-loss")
    finally:
        engine.close()
    sampling = {k: config[k] for k in ("temperature", "top_k", "top_p")}
    for g in groups:
        for r in g.rollouts:
            r.reward = float(r.sample_index)
            r.sampling = dict(sampling)
    return groups, sampling


def _format(batch: dict[str, Any], groups: list[Any], pad: int, eos: set[int]) -> list[dict[str, Any]]:
    """Every row as collate_groups must lay it out (module docstring); offenders name the row and the field."""
    out = []
    rollouts = [r for g in groups for r in g.rollouts]
    width = batch["input_ids"].shape[1]
    for b, r in enumerate(rollouts):
        p, n = int(r.prompt_ids.numel()), int(r.response_ids.numel())
        t = torch.arange(width)
        real = t < p + n
        response = (t >= p) & real
        mask = response.clone()
        if r.loss_mask is not None:
            mask[p : p + n] = r.loss_mask
        where = f"row {b} ({r.uid}, prompt {p} + response {n} tokens)"
        if not torch.equal(batch["input_ids"][b, :p].to(torch.int64), r.prompt_ids.to(torch.int64)) or not torch.equal(
                batch["input_ids"][b, p : p + n].to(torch.int64), r.response_ids.to(torch.int64)):
            out.append({"name": "input_ids", "what": f"{where}: tokens not prompt + response in order"})
        if not torch.equal(batch["attention_mask"][b].bool(), real):
            out.append({"name": "attention_mask", "what": f"{where}: not exactly the real tokens",
                        "positions": (batch["attention_mask"][b].bool() ^ real).nonzero().flatten()[:8].tolist()})
        got = batch["loss_mask"][b].bool()
        if not torch.equal(got, mask):
            bad = (got ^ mask).nonzero().flatten()
            kind = ("prompt" if bool((got & (t < p)).any()) else "padding" if bool((got & ~real).any())
                    else "response")
            out.append({"name": "loss_mask", "what": f"{where}: covers {kind} positions" if kind != "response"
                        else f"{where}: misses generated response positions", "positions": bad[:8].tolist()})
        if bool((batch["input_ids"][b, ~real] != pad).any()):
            out.append({"name": "padding", "what": f"{where}: padding positions hold tokens other than pad {pad}"})
        # tokens after the first eos: generate's padding of a finished row, taken as generated (a pad token anywhere
        # else may be a real sample of an untrained model: not a fault)
        stops = [i for i, tok in enumerate(r.response_ids.tolist()) if tok in eos]
        if stops and stops[0] < n - 1:
            out.append({"name": "response_ids", "what": f"{where}: {n - 1 - stops[0]} tokens after the eos at response "
                        f"position {stops[0]} (a finished row's padding taken as generated: the loss trains on it)"})
    return out


def _eos_ids(tokenizer: Any, policy: torch.nn.Module) -> set[int]:
    """The ids that end a response: the tokenizer's eos and the generation config's (an int or a list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = getattr(policy.generation_config, "eos_token_id", None)
    ids |= set(config) if isinstance(config, list) else {config} if isinstance(config, int) else set()
    return ids


def _padding_invariance(policy: torch.nn.Module, batch: dict[str, Any], sampling: dict[str, Any], config: Any,
                        pad: int) -> tuple[float, float]:
    """The batch widened by ``PADS`` padding columns (as a longer group would pad it), then its pad positions given
    other tokens: ``(max |loss - original loss|, max |d logprob| at real tokens)`` over both."""
    from asyncrl.train.logprobs import token_logprobs
    from asyncrl.train.losses import compute_loss

    fill = {"input_ids": pad, "attention_mask": False, "loss_mask": False, "rollout_logprobs": 0.0, "token_versions": -1}
    wide = {**batch, **{k: torch.cat([batch[k], torch.full((batch[k].shape[0], PADS), v, dtype=batch[k].dtype)], 1)
                        for k, v in fill.items()}}
    real = wide["attention_mask"].bool()
    vocab = int(policy.config.vocab_size)
    other = {**wide, "input_ids": torch.where(real, wide["input_ids"], (wide["input_ids"] + 1 + vocab // 2) % vocab)}
    width = batch["input_ids"].shape[1]
    with torch.no_grad():
        base = token_logprobs(policy, batch["input_ids"], batch["attention_mask"], **sampling)
        loss = compute_loss(batch, base, config=config)[0]
        losses, logp = [], []
        for b in (wide, other):
            lp = token_logprobs(policy, b["input_ids"], b["attention_mask"], **sampling)
            losses.append(float((compute_loss(b, lp, config=config)[0] - loss).abs()))
            logp.append(float(_abs_diff(lp[:, :width], base)[batch["attention_mask"].bool()].max()))
    return max(losses), max(logp)


def _positions(policy: torch.nn.Module, batch: dict[str, Any], sampling: dict[str, Any], pad: int,
               limit: float) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One row (the longest, the shortest) unpadded, right- and left-padded through the trainer's logprobs."""
    import asyncrl.train.logprobs as lp

    lengths = batch["attention_mask"].sum(-1)
    rows = sorted({int(lengths.argmax()), int(lengths.argmin())})
    offenders, worst = [], {"right": 0.0, "left": 0.0}
    for b in rows:
        n = int(lengths[b])
        ids = batch["input_ids"][b, :n][None]
        pads = torch.full((1, PADS), pad, dtype=ids.dtype)
        ones, zeros = torch.ones(1, n, dtype=torch.long), torch.zeros(1, PADS, dtype=torch.long)
        variants = {"right": (torch.cat([ids, pads], 1), torch.cat([ones, zeros], 1), slice(0, n)),
                    "left": (torch.cat([pads, ids], 1), torch.cat([zeros, ones], 1), slice(PADS, PADS + n))}
        base = lp.token_logprobs(policy, ids, ones, **sampling)[0]
        for side, (v_ids, v_mask, real) in variants.items():
            pos = lp.position_ids(v_mask)[0, real]
            if not torch.equal(pos, torch.arange(n)):
                wrong = (pos != torch.arange(n)).nonzero().flatten()
                offenders.append({"name": f"position_ids ({side} padding)", "what": f"row {b}: positions of the real "
                                  f"tokens are {pos[:6].tolist()}... instead of 0, 1, 2... (inconsistent with the "
                                  "attention mask)", "first_wrong_token": int(wrong[0])})
            got = lp.token_logprobs(policy, v_ids, v_mask, **sampling)[0, real]
            d = _abs_diff(got, base)
            d[0] = 0.0  # the first real token has no logprob in either
            worst[side] = max(worst[side], float(d.max()))
            if not float(d.max()) <= limit:
                offenders.append({"name": f"logprobs ({side} padding)", "what": f"row {b}: logprobs of the {side}-padded "
                                  "row differ from the unpadded row (positions or attention mask mishandled)",
                                  "max_abs": float(d.max()), "token": int(d.argmax()), "limit": limit})
    return offenders, worst


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` with equal infinities as 0 (``token_logprobs`` gives ``-inf`` to a prompt token outside top-k/top-p)
    and inf where only one side is finite."""
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(nan=math.inf, posinf=math.inf))


def _layer(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else name.removesuffix(".weight").removesuffix(".bias")


def _step(policy: torch.nn.Module, batch: dict[str, Any], sampling: dict[str, Any], config: Any,
          grad_limit: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The recipe's GRPO step on the batch: loss, per-layer gradient norms, then an AdamW step."""
    from asyncrl.train.logprobs import batch_logprobs
    from asyncrl.train.losses import compute_loss

    params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=LR)
    policy.train()
    logp = batch_logprobs(policy, batch, grad=True, expected=sampling)
    loss, loss_metrics, advantages = compute_loss(batch, logp, config=config)
    offenders: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"loss": float(loss.detach()), "advantages_nonzero": int((advantages != 0).sum()),
                               **{f"loss/{k}": v for k, v in loss_metrics.items()}}
    if not torch.isfinite(loss):
        offenders.append({"name": "loss", "what": "GRPO loss is not finite", "value": float(loss.detach())})
        return offenders, metrics
    loss.backward()
    norms: dict[str, float] = {}
    for name, p in params.items():
        g = p.grad
        sq = 0.0 if g is None else float(g.double().square().sum())
        norms[_layer(name)] = norms.get(_layer(name), 0.0) + sq
        if g is None or not torch.isfinite(g).all():
            offenders.append({"name": name, "what": "no gradient (not in the loss's graph)" if g is None
                              else "non-finite gradient"})
        elif sq == 0.0 and not _zero_by_construction(name, params):
            offenders.append({"name": name, "what": "zero gradient in a parameter that should train"})
    norms = {k: math.sqrt(v) for k, v in norms.items()}
    for layer, norm in norms.items():
        if not norm <= grad_limit and math.isfinite(norm):
            offenders.append({"name": layer, "what": "gradient norm over loss.grad_norm_max", "grad_norm": norm,
                              "limit": grad_limit})
    before = {n: p.detach().clone() for n, p in params.items()}
    optimizer.step()
    moved = sum(1 for n, p in params.items() if not torch.equal(p.detach(), before[n]))
    bad = [n for n, p in params.items() if not torch.isfinite(p).all()]
    offenders += [{"name": n, "what": "parameter not finite after the step"} for n in bad]
    policy.eval()
    metrics.update(grad_norm={k: round(v, 6) for k, v in norms.items()}, params_moved=moved, params=len(params),
                   grad_norm_max=max(norms.values(), default=0.0),
                   grad_norm_min=min(norms.values(), default=0.0))
    return offenders, metrics


def _zero_by_construction(name: str, params: dict[str, torch.Tensor]) -> bool:
    """Gradients that are exactly zero in a healthy model: a LoRA ``lora_A`` while its ``lora_B`` is all zero (peft's
    initialisation), and a key projection's bias (softmax is invariant to adding ``q . b_k`` to every score)."""
    if ".lora_A." in name:
        b = params.get(name.replace(".lora_A.", ".lora_B."))
        return b is not None and not bool(b.detach().any())
    return name.endswith("k_proj.bias")


def run(ctx: CheckContext) -> StageResult:
    """One GRPO step on the engine's rollouts (see the module docstring)."""
    from transformers import AutoTokenizer

    from asyncrl.config import LossConfig
    from asyncrl.train.corrections import mismatch_metrics
    from datapipes.collate import collate_groups

    t0 = time.perf_counter()
    _, skipped = begin_stage(ctx, "loss")
    if skipped is not None:
        return skipped
    torch.manual_seed(ctx.seed)
    policy = build_policy(ctx.model, dtype=ctx.dtype, lora_rank=ctx.lora_rank, seed=ctx.seed).eval()
    tokenizer = AutoTokenizer.from_pretrained(ctx.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = _eos_ids(tokenizer, policy)
    groups, sampling = _rollouts(ctx, policy)
    batch = collate_groups(groups, pad_token_id=pad)
    config = LossConfig()
    offenders = _format(batch, groups, pad, eos)
    pad_limit = _limit(ctx, "loss.pad_max_abs")
    loss_d, logp_d = _padding_invariance(policy, batch, sampling, config, pad)
    if not (loss_d <= pad_limit and logp_d <= pad_limit):
        offenders.append({"name": "padding", "what": "the loss depends on the tokens at padding positions",
                          "max_abs": max(loss_d, logp_d), "loss_delta": loss_d, "limit": pad_limit})
    found, worst = _positions(policy, batch, sampling, pad, pad_limit)
    offenders += found
    with torch.no_grad():
        from asyncrl.train.logprobs import batch_logprobs

        mismatch = mismatch_metrics(batch_logprobs(policy, batch, expected=sampling), batch["rollout_logprobs"],
                                    batch["loss_mask"])
    step_offenders, step = _step(policy, batch, sampling, config, _limit(ctx, "loss.grad_norm_max"))
    offenders += step_offenders
    metrics = {"rows": int(batch["input_ids"].shape[0]), "width": int(batch["input_ids"].shape[1]),
               "response_tokens": int(batch["loss_mask"].sum()), "pad_tokens": int((~batch["attention_mask"]).sum()),
               "pad_loss_delta": loss_d, "pad_logprob_max_abs": logp_d, "left_pad_max_abs": worst["left"],
               "right_pad_max_abs": worst["right"], "pad_max_abs_limit": pad_limit,
               **{f"mismatch/{k}": v for k, v in mismatch.items()}, **step}
    summary = (f"{metrics['rows']} rollouts, {metrics['response_tokens']} response tokens: loss {step['loss']:.4f}, "
               f"grad norms {step.get('grad_norm_min', 0):.1e}..{step.get('grad_norm_max', 0):.1e} over "
               f"{len(step.get('grad_norm', {}))} layers, left/right padding max |d logp| "
               f"{worst['left']:.1e}/{worst['right']:.1e}")
    return StageResult(stage="loss", ok=not offenders, summary=summary, offenders=offenders[: ctx.worst],
                       metrics=metrics, seconds=time.perf_counter() - t0)

"""Stage ``logprobs``: the same prompts, responses and weights through the engine and the trainer, per token, per rank.

    trainer (this process)                                 engine process (weights through the real broadcaster)
    publish v1 (the model directory) ─────────────────────► apply; generate K responses per prompt (the worker's call)
    compare (asyncrl.debug.align.compare): |dlogp|, k3, ratio tails, worst tokens in context
    topk: the engine's processed distribution over its top tokens  ◄── SamplingParams(logprobs=K) / HF's scores
          vs the trainer's renormalised one at the same prefixes (asyncrl.train.logprobs.sampling_logprobs)
    one AdamW step on the engine's rollouts, publish v2 ───► apply; generate again; compare + topk ("after step")
    Checkpointer.save → a fresh policy + Checkpointer.load → compare on v2's rollouts ("after resume")
    ranks: each rank count > 1 of --ranks launches that many trainer ranks (DDP/FSDP2 as --parallel), each
           loading the trained policy and comparing on v2's rollouts: one row per rank

Everything runs under the generation sampling settings (``--temperature``, ``--top-k``, ``--top-p``): the
engines report the logprob of the distribution actually sampled from, the trainer applies the same warpers.
The top-token comparison catches what a sampled-token-only check misses (vllm#42259): a side that
renormalises over the top-k/top-p support and a side that does not differ by ``log S`` on every token (S the
kept mass), a shifted support (a token one side filtered out and the other kept: ``support differs``), and
differences on tokens that were not sampled. Fails when, in any phase or rank, max ``|d|`` > ``logprobs.max_abs``,
mean ``|d|`` > ``logprobs.mean_abs``, k3 > ``logprobs.k3``, the top-token max ``|d|`` > ``logprobs.topk_max_abs``,
or a support differs. An engine that ignores a weight update (a LoRA adapter it does not reload, one update
behind) fails here after the step even where its weights cannot be read back.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch

from asyncrl.check import CheckContext, StageResult
from asyncrl.check._chain import Chain, check_prompts, load_trainer_policy, shared_chain

__all__ = ["run", "token_metrics", "topk_compare"]


def token_metrics(model: torch.nn.Module, groups: list[Any], ctx: Any) -> dict[str, Any]:
    """:func:`asyncrl.debug.align.compare` of ``model`` on the engine's ``groups``: metrics and worst tokens."""
    from asyncrl.debug.align import compare

    metrics, top = compare(model, groups, temperature=ctx.temperature, top_k=ctx.top_k, top_p=ctx.top_p,
                           worst=ctx.worst)
    names = ("row", "position", "trainer_logprob", "rollout_logprob", "abs_diff")
    metrics["worst"] = [dict(zip(names, w.tolist())) for w in top if not math.isnan(w[0])]
    return metrics


def topk_compare(model: torch.nn.Module, rows: list[dict[str, Any]], ctx: Any) -> dict[str, Any]:
    """The engine's processed top-token logprobs against the trainer's renormalised ones at the same prefixes.

    Returns:
        ``{"tokens": compared (position, token) pairs, "max_abs_diff", "mean_abs_diff", "support_differs": count,
        "worst": [{"row", "position", "token", "trainer_logprob", "engine_logprob", "abs_diff"}]}``.
    """
    from asyncrl.train.logprobs import sampling_logprobs

    diffs, worst, support = [], [], 0
    device = next(model.parameters()).device
    for i, r in enumerate(rows):
        prompt, response = r["prompt_ids"].long(), r["response_ids"].long()
        if response.numel() == 0:
            continue
        ids = torch.cat([prompt, response])[None].to(device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
        steps = logits[prompt.numel() - 1 : prompt.numel() - 1 + response.numel()]
        ours_all = sampling_logprobs(steps, temperature=ctx.temperature, top_k=ctx.top_k, top_p=ctx.top_p).cpu()
        top_ids, theirs = r["ids"].long(), r["logprobs"].double()
        valid = top_ids >= 0
        ours = ours_all.double().gather(1, top_ids.clamp(min=0))
        same_inf = torch.isinf(ours) & torch.isinf(theirs)
        one_inf = torch.isinf(ours) ^ torch.isinf(theirs)
        d = torch.where(same_inf, torch.zeros_like(ours), (ours - theirs).abs())
        support += int((one_inf & valid).sum())
        keep = valid & ~one_inf
        diffs.append(d[keep])
        for t, j in (valid & (one_inf | (d > 0))).nonzero().tolist():
            worst.append({"row": i, "position": prompt.numel() + t, "token": int(top_ids[t, j]),
                          "trainer_logprob": float(ours[t, j]), "engine_logprob": float(theirs[t, j]),
                          "abs_diff": math.inf if one_inf[t, j] else float(d[t, j])})
    flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    worst.sort(key=lambda w: -w["abs_diff"])
    return {"tokens": int(flat.numel()), "max_abs_diff": float(flat.max()) if flat.numel() else 0.0,
            "mean_abs_diff": float(flat.mean()) if flat.numel() else 0.0, "support_differs": support,
            "worst": worst[: ctx.worst]}


def _failures(phase: str, m: dict[str, Any], th: dict[str, float]) -> list[str]:
    out = []
    for key, metric in (("max_abs", "max_abs_diff"), ("mean_abs", "mean_abs_diff"), ("k3", "k3_kl")):
        if not m[metric] <= th[f"logprobs.{key}"]:  # NaN fails
            out.append(f"{metric} {m[metric]:.3g} > {th[f'logprobs.{key}']:g}")
    if m["tokens"] == 0:
        out.append("no tokens compared")
    top = m.get("topk")
    if top is not None:
        if not top["max_abs_diff"] <= th["logprobs.topk_max_abs"]:
            out.append(f"top-token max |d| {top['max_abs_diff']:.3g} > {th['logprobs.topk_max_abs']:g}")
        if top["support_differs"]:
            out.append(f"{top['support_differs']} top tokens in one side's top-k/top-p support only")
    return out


def _offenders(phase: str, m: dict[str, Any], groups: list[Any], tokenizer: Any, rank: int | None) -> list[dict]:
    from asyncrl.debug.align import token_context

    rows = [r for g in groups for r in g.rollouts]
    where = phase if rank is None else f"{phase}, rank {rank}"
    out = []
    for w in m["worst"]:
        rollout = rows[int(w["row"])]
        ids = torch.cat([rollout.prompt_ids, rollout.response_ids])
        out.append({"name": f"{rollout.uid} t={int(w['position'])}", "what": f"sampled token ({where})",
                    "abs_diff": w["abs_diff"], "trainer": w["trainer_logprob"], "engine": w["rollout_logprob"],
                    "context": token_context(tokenizer, ids, int(w["position"]))})
    for w in m.get("topk", {}).get("worst", []):
        what = "top token" if math.isfinite(w["abs_diff"]) else "top token in one side's support only"
        out.append({"name": f"row {w['row']} t={w['position']} token {w['token']}", "what": f"{what} ({where})",
                    "abs_diff": w["abs_diff"], "trainer": w["trainer_logprob"], "engine": w["engine_logprob"],
                    "token": tokenizer.decode([w["token"]], skip_special_tokens=False)})
    return out


class _NoLoader:
    """The check trains without a RolloutLoader: the checkpoint's loader file holds this empty state."""

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _resumed(chain: Chain, ctx: CheckContext) -> torch.nn.Module:
    """The policy saved with :class:`~asyncrl.checkpoint.Checkpointer` (model + optimizer) and loaded into a fresh one."""
    from asyncrl.checkpoint.checkpointer import Checkpointer

    root = chain.dir / f"checkpoints-v{chain.version}"
    base = None
    if ctx.qlora:  # as the recipe: adapter + its optimizer state, the 4-bit base named by hash
        from asyncrl.models.qlora import base_reference

        base = base_reference(chain.policy, ctx.model)
    fresh = load_trainer_policy(ctx)
    optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    saver = Checkpointer(root, fresh, optimizer, base=base)
    with warnings.catch_warnings():  # "assuming the intent is to save/load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        Checkpointer(root, chain.policy, chain.optimizer, _NoLoader(), base=base).save(step=1,
                                                                                     policy_version=chain.version)
        saver.load(saver.resolve(), loader=False)
    return fresh.eval()


def _ranks(chain: Chain, ctx: CheckContext, groups: list[Any], nproc: int) -> list[dict[str, Any]]:
    """``nproc`` trainer ranks, each comparing the trained policy on ``groups``; one metrics dict per rank."""
    from safetensors.torch import save_file

    from asyncrl.check._ranks import launch_ranks
    from asyncrl.codec import loads_json
    from asyncrl.debug.dump import write_dump

    out = chain.dir / f"ranks-{nproc}"
    out.mkdir(exist_ok=True)
    state = out / "policy.safetensors"
    if not state.exists():
        trained = {n: p for n, p in chain.policy.named_parameters() if p.requires_grad}  # a 4-bit base is loaded
        save_file({k: v.detach().contiguous().clone() for k, v in trained.items()}, state)
    write_dump(out / "groups.msgpack", "check_groups", {"groups": [g.to_wire() for g in groups]})
    argv = ["-m", "asyncrl.check._logprob_rank", "--model", ctx.model, "--dtype", ctx.dtype, "--lora", str(ctx.lora_rank),
            "--parallel", ctx.parallel, "--state", str(state), "--groups", str(out / "groups.msgpack"),
            "--out", str(out), "--temperature", str(ctx.temperature), "--top-k", str(ctx.top_k),
            "--top-p", str(ctx.top_p), "--worst", str(ctx.worst), "--seed", str(ctx.seed),
            *(["--qlora"] if ctx.qlora else []), *(a for m in ctx.imports for a in ("--import", m))]
    results = launch_ranks(argv, nproc, timeout_s=600)
    if failed := [r for r in results if r.returncode != 0]:
        raise RuntimeError(f"trainer rank {failed[0].rank} of {nproc} exited {failed[0].returncode}:\n{failed[0].tail()}")
    return [loads_json((out / f"rank-{r}.json").read_bytes()) for r in range(nproc)]


def run(ctx: CheckContext) -> StageResult:
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(ctx.model)
    th = ctx.thresholds
    phases: dict[str, dict[str, Any]] = {}
    offenders, problems = [], []

    def record(phase: str, m: dict[str, Any], groups: list[Any], rank: int | None = None) -> None:
        key = phase if rank is None else f"{phase}, rank {rank}"
        phases[key] = m
        if bad := _failures(key, m, th):
            problems.append(f"{key}: {'; '.join(bad)}")
            offenders.extend(_offenders(phase, m, groups, tokenizer, rank))

    prompts, groups, loss = check_prompts(ctx), [], None
    chain = shared_chain(ctx)
    for phase in ("before step", "after step"):
        if phase == "after step":
            loss = chain.step(groups)
        chain.publish()
        groups = chain.engine.generate(prompts, ctx.samples)
        m = token_metrics(chain.policy, groups, ctx)
        m["topk"] = topk_compare(chain.policy, chain.engine.topk(prompts, ctx.samples, ctx.topk_logprobs), ctx)
        record(phase, m, groups)
    record("after resume", token_metrics(_resumed(chain, ctx), groups, ctx), groups)
    for nproc in (n for n in ctx.ranks if n > 1):
        for rank, m in enumerate(_ranks(chain, ctx, groups, nproc)):
            record(f"{nproc} {ctx.parallel} ranks", m, groups, rank)
    worst = max((m["max_abs_diff"] for m in phases.values()), default=math.nan)
    top = max((m["topk"]["max_abs_diff"] for m in phases.values() if "topk" in m), default=math.nan)
    summary = (f"{len(phases)} comparisons (before/after a step, after resume, ranks {ctx.ranks}), "
               f"{phases['before step']['tokens']:.0f} tokens each: max |d| {worst:.2e}, top-{ctx.topk_logprobs} "
               f"max |d| {top:.2e}")
    if problems:
        summary = f"{summary}; {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
    # the worst sampled tokens (in context) first, then the worst top tokens: both kinds are listed
    sampled = sorted((o for o in offenders if "context" in o), key=lambda o: -o["abs_diff"])
    top = sorted((o for o in offenders if "context" not in o), key=lambda o: -o["abs_diff"])
    offenders = sampled[: max(1, ctx.worst - ctx.worst // 2)] + top[: ctx.worst // 2] if top else sampled
    metrics = {"phases": phases, "problems": problems, "loss": loss,
               "sampling": {"temperature": ctx.temperature, "top_k": ctx.top_k, "top_p": ctx.top_p}}
    return StageResult(stage="logprobs", ok=not problems, summary=summary, offenders=offenders[: ctx.worst],
                       metrics=metrics, seconds=time.perf_counter() - t0)

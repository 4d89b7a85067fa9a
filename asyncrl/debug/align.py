"""``asyncrl align``: the rollout/trainer logprob alignment gate.

Same prompts, same responses, same weights: the rollout engine (``hf`` or ``vllm``, built exactly as a
worker builds it) samples ``K`` responses to each of ``N`` prompts and reports the logprob of every
sampled token; the trainer side loads the model directory (and the recipe's DCP checkpoint), collates
the rollouts exactly like training (``Rollout``/``Group`` -> ``collate_groups``) and recomputes those
logprobs with :func:`asyncrl.train.logprobs.token_logprobs` under the same temperature/top-k/top-p. What is
compared is ``d = trainer - rollout`` at every ``loss_mask`` position (the generated tokens)::

    asyncrl align --model runs/grpo/model --engine vllm --checkpoint runs/grpo/checkpoints/step-000040
    torchrun --nproc-per-node 2 -m asyncrl.debug.align --model DIR --checkpoint CKPT   # one row per rank

Reported per trainer rank: tokens compared, max and mean ``|d|``, the k3 estimate of
``KL(rollout || trainer)`` (mean of ``(r - 1) - log r`` with ``r = exp(d)``, unbiased because tokens
are sampled from the rollout policy), the tails of ``r`` (min, p0.1, p99.9, max), and the ``--worst``
tokens shown in context (``...3+4=[7]<eos>``: the token in brackets). With ``--top-k``, a token whose
distribution has its k-th and (k+1)-th logits tied (within :data:`TIE_TOL`) is counted as ``topk_ties`` and left
out (its support is decided by rounding, not by the weights). The exit status is 0 when
``max |d| <= --threshold`` on every rank, 1 otherwise, 2 for usage errors; ``--json`` writes every
number.

The threshold: in fp32 the HF and vLLM-CPU engines agree with the trainer forward to ~1e-6 (measured
2e-7..7e-7 on the tiny model), so the default 1e-3 fails only on a real mismatch: weights one update
apart (~0.4 on the tiny model), a wrong sampling parameter, a tokenizer or position-id bug. In bf16 the
two sides round differently even with equal weights: on the tiny model max |d| ~4e-3, mean ~5e-4, k3
~3e-7 (both engines); large models on GPU kernels commonly reach max |d| of 0.1 or more while the mean
and k3 stay small. Gate bf16 with a threshold taken from a known-good run (e.g. ``--threshold 0.1``)
and watch the mean, k3 and ratio tails rather than the max alone.

As a gate: run it before launching a run (``--checkpoint`` omitted: the model directory on both sides)
and in CI; after a resume, point it at the checkpoint being resumed (``--checkpoint
run/checkpoints/step-000040``) to prove that the engine, loaded through the real weight-update path
(``engine.apply_weights(WeightUpdate(mode="full"))``), computes what the trainer computes.
``--engine-checkpoint`` (default: ``--checkpoint``; ``none`` = the model directory's weights) loads
other weights into the engine, e.g. one step behind to see what one update of lag looks like. LoRA
checkpoints of the recipe (adapter keys in the DCP model section, ``lora`` section in the checkpoint's
``config.json``) are supported: the trainer wraps the model with peft, the engine gets a ``lora`` update.

Who blocks on what: under torchrun (``WORLD_SIZE > 1``) rank 0 generates, in a child process without
the torchrun environment (vLLM sets up ``torch.distributed`` itself and would otherwise try to join the
ranks' group), while the other ranks wait in a gloo broadcast (up to an hour); the rollouts travel as
codec frames (one uint8 tensor plus frame lengths, no pickle);
every rank computes with its own replica loaded independently from DIR/CKPT, and ``all_gather`` brings
every rank's numbers to every rank, so all ranks exit with the same status and rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["compare", "groups_from_completions", "load_policy", "main", "token_context"]

CHECKPOINT_MODEL = "model"
"""The model section of the recipe's DCP checkpoints (``GRPORecipe.CHECKPOINT_MODEL``)."""
_KIND = "align_groups"
_ROWS_PER_FORWARD = 32
_METRICS = ("tokens", "nonfinite", "max_abs_diff", "mean_abs_diff", "k3_kl", "ratio_min", "ratio_p0.1",
            "ratio_p99.9", "ratio_max", "topk_ties")
TIE_TOL = 1e-5
"""A top-k boundary closer than this (the k-th and (k+1)-th temperature-scaled logits of the trainer's forward) is a
tie: fp32 engines agree with the trainer to ~1e-6, so which of the tied tokens is in the engine's top-k is rounding,
and the sampled token's logprob (renormalised over k or k+1 tokens: ``TopKLogitsWarper`` keeps every token tied
with the k-th) may differ by ~1/k without any weight or code mismatch. Such tokens are counted (``topk_ties``) and
left out of the other metrics; a real mismatch moves every token, not only these."""
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_WORST = ("row", "position", "trainer_logprob", "rollout_logprob", "abs_diff")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl align", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (the recipe's run_dir/model)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--checkpoint", help="recipe DCP checkpoint for the trainer side (and the engine by default)")
    p.add_argument("--engine-checkpoint", help="DCP checkpoint for the engine; 'none' = the model dir's weights")
    p.add_argument("--prompts", type=int, default=16, help="N arithmetic prompts (asyncrl.data.tasks)")
    p.add_argument("--prompts-file", help='JSONL of {"text": ...} (or {"prompt_ids": [...]}, or {"messages": [...], '
                   '"images": [paths]} for a vision-language model) lines instead')
    p.add_argument("--images", action="store_true", help="N image prompts of the visual task (asyncrl.data) "
                   "instead of arithmetic: --model must be a vision-language model")
    p.add_argument("--samples", type=int, default=4, help="K responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--kv-cache-mb", type=int, default=64, help="vllm: KV cache size")
    p.add_argument("--threshold", type=float, default=1e-3, help="largest max |dlogp| that passes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write all numbers here (orjson)")
    p.add_argument("--worst", type=int, default=5, help="tokens with the largest |dlogp| shown per rank")
    # fault injection for this tool's own tests: this rank adds noise to its replica, as a bad copy would
    p.add_argument("--perturb-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--generate-to", help=argparse.SUPPRESS)  # the engine child of rank 0 under torchrun
    return p


def _read_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Any]:
    from asyncrl.codec import loads_json
    from asyncrl.data.tasks import arithmetic_prompts

    if args.images and not args.prompts_file:  # rendered by the model's processor, images as PNG bytes
        from asyncrl.config import DataConfig
        from asyncrl.data.prompts import load_prompts

        return list(load_prompts(DataConfig(source="visual_count", num_prompts=args.prompts, seed=args.seed),
                                 args.model))
    if not args.prompts_file:
        return arithmetic_prompts(args.prompts, seed=args.seed)
    lines = [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    prompts = [loads_json(line) for line in lines]
    if not prompts or not all(isinstance(p, dict) and ("text" in p or "prompt_ids" in p or "images" in p)
                              for p in prompts):
        parser.error(f"--prompts-file {args.prompts_file}: need one JSON object with 'text', 'prompt_ids' or "
                     "'messages' + 'images' per line")
    if any(p.get("images") for p in prompts):
        from asyncrl.config import DataConfig
        from asyncrl.data.prompts import load_prompts

        return list(load_prompts(DataConfig(source="datasets", path=args.prompts_file), args.model))
    return prompts


def load_policy(model_dir: str, checkpoint: str | None, dtype: torch.dtype) -> torch.nn.Module:
    """The trainer's model: the model directory, then the model section of a recipe DCP checkpoint.

    A checkpoint with LoRA adapter keys is loaded into a peft-wrapped model configured from the
    ``lora`` section of the checkpoint's ``config.json`` (which the recipe writes next to it). A QLoRA checkpoint
    (its ``base.json`` names the base by hash) holds only the adapter: the base is ``model_dir`` loaded in 4-bit
    as the trainer loaded it (:func:`asyncrl.models.qlora.load_quantized_base`), refused if its hash differs.
    """
    import torch.distributed.checkpoint as dcp

    from asyncrl.checkpoint.checkpointer import BASE, check_base
    from asyncrl.models.loading import load_causal_lm

    qlora = bool(checkpoint) and (Path(checkpoint) / BASE).exists()
    if qlora:
        from asyncrl.models.qlora import base_reference, load_quantized_base

        model = load_quantized_base(model_dir, dtype=str(dtype).removeprefix("torch."))
        check_base(Path(checkpoint), base_reference(model, model_dir))
    else:
        model = load_causal_lm(model_dir, dtype)  # a vision-language model's class for a VLM directory
    if checkpoint:
        keys = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        if any(".lora_" in k for k in keys if k.startswith(f"{CHECKPOINT_MODEL}.")):
            from peft import LoraConfig, get_peft_model

            from asyncrl.codec import loads_json

            lora = loads_json((Path(checkpoint) / "config.json").read_bytes())["lora"]
            model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                                                     target_modules=lora["target_modules"]))
        state = {CHECKPOINT_MODEL: {k: v for k, v in model.state_dict().items() if not qlora or ".lora_" in k}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, checkpoint_id=checkpoint)
        model.load_state_dict(state[CHECKPOINT_MODEL], strict=not qlora)
    return model.eval()


def _weight_update(model: torch.nn.Module) -> Any:
    """The model's weights as the recipe publishes them (full state dict, or only the LoRA adapter)."""
    from asyncrl.weights.base import WeightUpdate

    mode, config, tensors = "full", None, model.state_dict()
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        raw = model.peft_config["default"].to_dict()
        config = {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in raw.items()}
        mode, tensors = "lora", get_peft_model_state_dict(model)
    # cloned as a receiver's copy would be: tied embeddings must not share storage (safetensors refuses)
    tensors = {k: v.detach().clone() for k, v in tensors.items()}
    return WeightUpdate(version=1, mode=mode, tensors=tensors, lora_config=config)


def _generate(args: argparse.Namespace, prompts: list[Any], tokenizer: Any, model: torch.nn.Module) -> list[Any]:
    """Rank 0: K samples per prompt from the engine, loaded with the engine checkpoint, as groups."""
    from asyncrl.config import EngineConfig, from_dict
    from asyncrl.models.qlora import is_quantized
    from workers.engines import GenerationRequest, build_engine, prompt_token_ids

    ckpt = args.checkpoint if args.engine_checkpoint is None else args.engine_checkpoint
    update = None
    if ckpt != "none" and ckpt is not None:
        update = _weight_update(model if ckpt == args.checkpoint else load_policy(args.model, ckpt, model.dtype))
    longest = max(prompt_token_ids(p, tokenizer).numel() for p in prompts)
    lora_rank = update.lora_config["r"] if update is not None and update.mode == "lora" else 0
    own = ({"max_model_len": longest + args.max_new_tokens, "kv_cache_bytes": args.kv_cache_mb << 20}
           if args.engine == "vllm" else {})
    if is_quantized(model):  # a QLoRA checkpoint: the same 4-bit base (an hf field: vLLM is refused, with the reason)
        own["quantization"] = "nf4"
    engine = build_engine(from_dict(EngineConfig, dict(
        type=args.engine, model=args.model, dtype=args.dtype, seed=args.seed, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens, min_new_tokens=0,
        lora_rank=lora_rank, **own)))
    try:
        if update is not None:
            engine.apply_weights(update)  # the real update path of a worker
        requests = [GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=args.samples) for i, p in enumerate(prompts)]
        completions = engine.generate(requests)
    finally:
        engine.close()
    return groups_from_completions(completions, worker_id=f"align-{args.engine}", prompts=prompts)


def groups_from_completions(completions: list[list[Any]], *, worker_id: str,
                            prompts: list[Any] | None = None) -> list[Any]:
    """An engine's ``generate`` output (one list of completions per request, request ``i`` = prompt ``i``) as the
    :class:`~asyncrl.rollout.Group` s a worker would send (``asyncrl check``'s logprobs stage shares it); with the
    ``prompts``, image prompts' rollouts carry their images as a worker's do."""
    from asyncrl.data.images import prompt_images
    from asyncrl.rollout import Group, Rollout

    images = [prompt_images(p) for p in prompts] if prompts is not None else [[] for _ in completions]
    return [
        Group(epoch=0, prompt_index=i, rollouts=[
            Rollout(epoch=0, prompt_index=i, sample_index=s, worker_id=worker_id,
                    policy_version=c.policy_version, version_spans=c.version_spans, prompt_ids=c.prompt_ids,
                    response_ids=c.response_ids, logprobs=c.logprobs, loss_mask=c.loss_mask,
                    finish_reason=c.finish_reason, images=list(images[i]))
            for s, c in enumerate(cs)])
        for i, cs in enumerate(completions)
    ]


def _generate_in_child(argv: list[str]) -> list[Any]:
    """Rank 0 under torchrun: the engine runs in a child process without the torchrun environment, so
    that vLLM's own ``torch.distributed`` set-up cannot join (and hang in) the trainer ranks' group;
    the groups come back as a codec dump file."""
    from asyncrl.debug.dump import read_dump
    from asyncrl.rollout import Group

    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    with tempfile.TemporaryDirectory(prefix="asyncrl-align-") as tmp:
        out = Path(tmp) / "groups.msgpack"
        cmd = [sys.executable, "-m", "asyncrl.debug.align", *argv, "--generate-to", str(out)]
        subprocess.run(cmd, env=env, check=True)
        kind, body = read_dump(out)
        if kind != _KIND:
            raise RuntimeError(f"the engine child wrote a {kind!r} dump, expected {_KIND!r}")
        return [Group.from_wire(g) for g in body["groups"]]


def _share_groups(groups: list[Any] | None, rank: int) -> list[Any]:
    """Rank 0's groups on every rank, as codec frames in one uint8 tensor; ``None`` on rank 0 = it failed."""
    import torch.distributed as dist

    from asyncrl.codec import decode, encode
    from asyncrl.rollout import Group

    count = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        frames = [] if groups is None else encode(_KIND, {"groups": [g.to_wire() for g in groups]})
        count[0] = len(frames) if frames else -1
    dist.broadcast(count, src=0)
    if count.item() < 0:
        if rank == 0:
            return []
        raise RuntimeError("rank 0 failed to generate the rollouts; its log has the error")
    sizes = [memoryview(f).nbytes for f in frames] if rank == 0 else [0] * int(count.item())
    lengths = torch.tensor(sizes, dtype=torch.int64)
    dist.broadcast(lengths, src=0)
    data = torch.frombuffer(bytearray(b"".join(bytes(f) for f in frames)), dtype=torch.uint8) if rank == 0 else \
        torch.empty(int(lengths.sum()), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    if rank == 0:
        return groups
    raw = data.numpy().tobytes()
    offsets = [0, *lengths.cumsum(0).tolist()]
    kind, body = decode([raw[a:b] for a, b in zip(offsets, offsets[1:])], max_message_bytes=len(raw) + 1)
    if kind != _KIND:
        raise RuntimeError(f"rank 0 sent a {kind!r} message, expected {_KIND!r}")
    return [Group.from_wire(g) for g in body["groups"]]


def compare(model: torch.nn.Module, groups: list[Any], *, temperature: float, top_k: int, top_p: float,
            worst: int, processor: Any = None) -> tuple[dict[str, float], torch.Tensor]:
    """Trainer-side logprobs of the groups' tokens against the rollout-side ones (image prompts: the model's
    ``processor`` re-runs on the rollouts' image bytes).

    Returns:
        ``(metrics, worst_tokens)``: metrics named as ``_METRICS``; ``worst_tokens`` float64
        ``[worst, 5]`` rows of ``_WORST`` (rows of the collated batch, in group order), NaN-padded.
    """
    from asyncrl.data.images import processor_inputs, vision_token_ids
    from asyncrl.train.logprobs import token_logprobs
    from datapipes.collate import collate_groups

    per_forward = max(1, _ROWS_PER_FORWARD // max(len(g.rollouts) for g in groups))
    cols: list[list[torch.Tensor]] = [[] for _ in _WORST]
    row0, ties = 0, 0
    for start in range(0, len(groups), per_forward):
        batch = collate_groups(groups[start : start + per_forward])
        p = next(model.parameters())
        images = processor_inputs(processor, batch["images"], device=p.device, dtype=p.dtype) if "images" in batch \
            else None
        ours = token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature=temperature,
                              top_k=top_k, top_p=top_p, images=images,
                              suppress_token_ids=vision_token_ids(processor)).cpu().double()
        theirs, mask = batch["rollout_logprobs"].double(), batch["loss_mask"]
        tied = _topk_ties(model, batch, images, temperature=temperature, top_k=top_k,
                          suppress_token_ids=vision_token_ids(processor))
        ties += int((tied & mask).sum())
        mask = mask & ~tied
        rows, pos = mask.nonzero(as_tuple=True)
        for col, value in zip(cols, (rows + row0, pos, ours[mask], theirs[mask], (ours - theirs)[mask].abs())):
            col.append(value.double())
        row0 += batch["input_ids"].shape[0]
    row, pos, trainer, rollout, absdiff = (torch.cat(c) for c in cols)
    absdiff, d = absdiff.nan_to_num(nan=float("inf")), trainer - rollout
    ratio = torch.exp(d)
    finite = ratio[torch.isfinite(ratio)]
    tails = torch.tensor([0.001, 0.999], dtype=torch.float64)
    q = torch.quantile(finite, tails).tolist() if finite.numel() else [math.nan] * 2
    lo, hi = (ratio.min(), ratio.max()) if ratio.numel() else (math.nan, math.nan)
    values = (absdiff.numel(), (~torch.isfinite(d)).sum(), absdiff.max() if absdiff.numel() else math.nan,
              absdiff.mean(), ((ratio - 1) - d).mean(), lo, q[0], q[1], hi, ties)
    metrics = {name: float(v) for name, v in zip(_METRICS, values)}
    top = torch.full((worst, len(_WORST)), math.nan, dtype=torch.float64)
    idx = absdiff.topk(min(worst, absdiff.numel())).indices
    top[: idx.numel()] = torch.stack([row, pos, trainer, rollout, absdiff], dim=1)[idx]
    return metrics, top


def _topk_ties(model: torch.nn.Module, batch: dict[str, Any], images: dict[str, torch.Tensor] | None, *,
               temperature: float, top_k: int, suppress_token_ids: Any) -> torch.Tensor:
    """``[B, L]`` bool: token ``t``'s distribution (the logits at ``t - 1``) has a top-k boundary tie (:data:`TIE_TOL`);
    all False without top-k (or ``top_k >= V``). One extra no-grad forward of the batch."""
    from asyncrl.train.logprobs import position_ids

    ids, attn = batch["input_ids"], batch["attention_mask"]
    if top_k <= 0:
        return torch.zeros(ids.shape, dtype=torch.bool)
    device = next(model.parameters()).device
    mask = attn.to(device=device, dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids.to(device=device, dtype=torch.long), attention_mask=mask,
                       position_ids=position_ids(mask), **(images or {})).logits
    if top_k >= logits.shape[-1]:
        return torch.zeros(ids.shape, dtype=torch.bool)
    scores = logits[:, :-1].float() / temperature
    if suppress_token_ids:
        scores[..., list(suppress_token_ids)] = -float("inf")
    top = scores.topk(top_k + 1, dim=-1).values
    tied = (top[..., top_k - 1] - top[..., top_k]) <= TIE_TOL
    return torch.cat([torch.zeros_like(tied[:, :1]), tied], dim=1).cpu()


def token_context(tokenizer: Any, ids: torch.Tensor, position: int, before: int = 24, after: int = 8) -> str:
    """``...prefix[token]suffix`` around ``ids[position]``, special tokens shown."""
    def text(a: int, b: int) -> str:
        return tokenizer.decode(ids[max(a, 0) : b].tolist(), skip_special_tokens=False)

    lead = "..." if position > before else ""
    token = text(position, position + 1) or f"<id {int(ids[position])}>"  # ids past the tokenizer decode to ""
    return f"{lead}{text(position - before, position)}[{token}]{text(position + 1, position + 1 + after)}"


def _report(ranks: list[dict[str, Any]], groups: list[Any], tokenizer: Any, threshold: float) -> None:
    head = ["rank", "tokens", "max|d|", "mean|d|", "k3 KL", "r min", "r p0.1", "r p99.9", "r max", "ties", "ok"]
    names = _METRICS[2:-1]
    print(f"trainer - rollout logprobs (d), r = exp(d), k3 = KL(rollout||trainer); threshold max|d| <= {threshold:g}")
    print(" ".join(f"{h:>9}" for h in head))
    for r in ranks:
        cells = [f"{r['rank']:>9}", f"{int(r['tokens']):>9}", *(f"{r[n]:>9.2e}" for n in names),
                 f"{int(r['topk_ties']):>9}"]
        print(" ".join(cells) + f" {'PASS' if r['passed'] else 'FAIL':>9}")
    rows = [r for g in groups for r in g.rollouts]  # collated row order
    for r in ranks:
        if len(ranks) > 1 or r["worst"]:
            print(f"worst tokens, rank {r['rank']}:")
        for w in r["worst"]:
            rollout = rows[w["row"]]
            ids = torch.cat([rollout.prompt_ids, rollout.response_ids])
            w["uid"], w["context"] = rollout.uid, token_context(tokenizer, ids, w["position"])
            print(f"  |d|={w['abs_diff']:.2e} trainer={w['trainer_logprob']:.4f} rollout={w['rollout_logprob']:.4f} "
                  f"{w['uid']} t={w['position']}: {w['context']!r}")


def _gather(metrics: dict[str, float], top: torch.Tensor, world: int, threshold: float) -> list[dict[str, Any]]:
    """Every rank's metrics and worst tokens, on every rank (one float64 tensor per rank)."""
    import torch.distributed as dist

    local = torch.cat([torch.tensor([metrics[n] for n in _METRICS], dtype=torch.float64), top.flatten()])
    gathered = [local]
    if world > 1:
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
    ranks = []
    for r, t in enumerate(gathered):
        row = {"rank": r, **dict(zip(_METRICS, t[: len(_METRICS)].tolist()))}
        row["passed"] = row["tokens"] > 0 and row["max_abs_diff"] <= threshold
        worst = t[len(_METRICS) :].view(-1, len(_WORST))
        row["worst"] = [dict(zip(_WORST, w.tolist())) for w in worst if not torch.isnan(w[0])]
        for w in row["worst"]:
            w["row"], w["position"] = int(w["row"]), int(w["position"])
        ranks.append(row)
    return ranks


def main(argv: list[str]) -> int:
    """Runs the alignment test; returns the exit status (0 pass, 1 above threshold; usage errors exit 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.samples < 1 or args.max_new_tokens < 1 or args.worst < 0:
        parser.error("--prompts, --samples and --max-new-tokens must be >= 1, --worst >= 0")
    if not Path(args.model, "config.json").is_file():
        parser.error(f"--model {args.model} is not a model directory (no config.json)")
    for ckpt in {args.checkpoint, args.engine_checkpoint} - {None, "none"}:
        if not Path(ckpt, ".metadata").is_file():
            parser.error(f"{ckpt} is not a torch.distributed.checkpoint directory (no .metadata)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = _read_prompts(args, parser)
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from asyncrl.codec import dumps_json
    from asyncrl.debug.dump import write_dump

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # ranks > 0 wait for rank 0's generation in a broadcast: allow it an hour
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
    rank = dist.get_rank() if world > 1 else 0
    model = load_policy(args.model, args.checkpoint, getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model) if rank == 0 else None
    if args.generate_to:
        groups = _generate(args, prompts, tokenizer, model)
        write_dump(args.generate_to, _KIND, {"groups": [g.to_wire() for g in groups]})
        return 0
    groups = None
    if rank == 0:
        try:
            groups = _generate_in_child(argv) if world > 1 else _generate(args, prompts, tokenizer, model)
        finally:  # the other ranks wait in a broadcast: tell them rank 0 failed rather than leave them hanging
            if world > 1 and groups is None:
                _share_groups(None, rank)
    if world > 1:
        groups = _share_groups(groups, rank)
    if args.perturb_rank == rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)).to(p.dtype) * 1e-3)
    from asyncrl.models.loading import load_processor

    metrics, top = compare(model, groups, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           worst=args.worst, processor=load_processor(args.model))
    ranks = _gather(metrics, top, world, args.threshold)
    passed = all(r["passed"] for r in ranks)
    if rank == 0:
        _report(ranks, groups, tokenizer, args.threshold)
        if args.json:
            summary = {"passed": passed, "threshold": args.threshold, "args": vars(args), "ranks": ranks,
                       "max_abs_diff": max(r["max_abs_diff"] for r in ranks)}
            Path(args.json).write_bytes(dumps_json(summary))
        failed = [r["rank"] for r in ranks if not r["passed"]]
        print("PASS" if passed else f"FAIL: max |d| above {args.threshold:g} on ranks {failed}")
    if world > 1:  # nobody exits before rank 0 has reported: torchrun ends every rank when one exits non-zero
        dist.barrier()
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Asynchronous GRPO, in one file: trainer ranks under torchrun, rollout workers behind a RolloutLoader.

    torchrun --nproc-per-node 2 recipes/grpo.py --config recipes/configs/tiny_cpu.yaml
    torchrun --nproc-per-node 2 recipes/grpo.py --config recipes/configs/tiny_cpu.yaml --resume
    torchrun --nproc-per-node 2 recipes/grpo.py --config recipes/configs/tiny_cpu.yaml rollout.max_staleness=0
    torchrun --nproc-per-node 1 recipes/grpo.py --config recipes/configs/tiny_cpu.yaml lora.rank=8 train.lr=0.003
    torchrun --nproc-per-node 2 recipes/grpo.py --config recipes/configs/tiny_cpu.yaml report_to=[tensorboard]

(LoRA: at ``train.lr=0.01`` the update guard rejects nearly every update of the adapter, whose B matrices start at
zero; at 0.003 every update is accepted and the reward rises.)

The run file's sections are ``asyncrl.config.RecipeConfig``'s (each component's own config class).
One knob selects the regime: ``rollout.max_staleness`` = 0 (synchronous, on-policy), 1 (one-step
off-policy), k (fully async). Per step, on every rank::

    batch = next(loader)                        # groups of this rank's shard, no staler than max_staleness
    logp  = token_logprobs(policy, batch)       # trainer-side forward (DDP)
    loss  = compute_loss(batch, logp, config=loss)  # asyncrl.train: advantages, loss_type (+ KL to the reference)
    verdict = guard.step(loss)                  # asyncrl.train.guard: backward, clip, step; a non-finite loss/grad or
                                                #   |dtheta|/|theta| > max is undone exactly (the batch is dumped)
    sync.commit(verdict.accepted)               # asyncrl.train.policy_sync: the pool's version moves, then rank 0
                                                #   publishes the weights (or only the LoRA adapter)

Outputs in ``run_dir``: ``metrics.jsonl`` (one line per step, rank 0), ``consumed-rank{r}.jsonl`` (the groups each rank
trained on), ``checkpoints/step-N`` (model + optimizer via torch.distributed.checkpoint, loader state per rank, version,
RNG, config; staged, marked COMPLETE, renamed, then ``latest`` moves: see asyncrl.checkpoint.checkpointer), ``.lock``
(held by rank 0 while the run lives, naming it: a second run on the directory is refused; asyncrl.checkpoint.run_dir),
``dumps/`` (rejected and anomalous batches, msgpack), ``report.png`` (reward and staleness over steps), ``debug/`` (the
debugger's per-step record and anomalies), ``report/index.html``, ``samples.jsonl`` (rollouts as text every
``debug.samples_every`` steps and each anomaly's batch: asyncrl.debug.samples), ``summary.json`` (the end-of-run
summary, also printed last: asyncrl.debug.summary), and the trackers ``report_to`` names (``tensorboard/``, ``wandb/``,
``mlflow.db``; their run ids in ``trackers.json``, continued by ``--resume``: asyncrl.integrations.trackers).

The progress bar counts the update guard's verdicts; a run in which every update of this launch was rejected exits
non-zero after its summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a rank: no cyclic collections over the heap the imports build (asyncrl._gc)
    gc.disable()

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from asyncrl import (  # the public surface: every component the recipe picks
    Checkpointer,
    Debugger,
    PolicySync,
    RecipeConfig,
    ReferencePolicy,
    RolloutLoader,
    RunDirLocked,
    UpdateGuard,
    adamw,
    batch_sampling,
    component_means,
    compute_loss,
    continue_records,
    hold_run_dir,
    load_causal_lm,
    load_config,
    load_processor,
    load_prompts,
    mismatch_metrics,
    parallelize,
    record_files,
    reward_weights,
    start_weight_sync,
    token_logprobs,
)
from asyncrl._gc import freeze_import_heap
from asyncrl.cluster.registry import pool_record, write_pool_record
from asyncrl.codec import dumps_json
from asyncrl.config import to_dict
from asyncrl.data.images import processor_inputs, vision_token_ids
from asyncrl.data.prompts import sft_batch
from asyncrl.debug.plot import plot
from asyncrl.debug.rejection import replay_rejection, write_rejected_batch  # noqa: F401 (tests replay from here)
from asyncrl.debug.samples import SampleLog
from asyncrl.debug.summary import GuardWatch, format_summary, run_summary, write_summary
from asyncrl.integrations.trackers import Trackers, resolve_report_to
from asyncrl.lifeline import die_with_parent, end_run  # noqa: F401 (tests and benchmarks end runs with it)
from asyncrl.models.loading import check_model_dir
from asyncrl.pool.timeline import new_incarnation
from asyncrl.rewards.preflight import reward_columns, try_rewards, worker_env
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.testing.tiny_vlm import build_tiny_vlm
from asyncrl.train.losses import all_reduce_sum
from asyncrl.train.step_metrics import batch_stats, global_metrics, pipeline_counters
from asyncrl.train.threads import trainer_threads

# ----------------------------------------------------------------------------------------------------------------------
# the recipe


class GRPORecipe:
    def __init__(self, cfg: RecipeConfig, resume: bool):
        self.cfg = cfg
        self.resume = resume

    # -- setup -----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        # first of all: a rank never outlives its launcher (torchrun runs ranks in sessions of their own, so killing
        # its process group misses them); one orphaned earlier cannot join the rendezvous torchrun hosted
        die_with_parent(what=f"trainer rank {os.environ.get('RANK', '?')}")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(cfg.train.seed)
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        try:  # rank 0 holds the lock for the whole run; every rank leaves at once if another run holds it
            self.run_lock = hold_run_dir(self.run_dir)  # before anything is written into it
        except RunDirLocked as e:
            dist.destroy_process_group()
            raise SystemExit(f"[rank {self.rank}] {e}") from None
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_bytes(dumps_json(dataclasses.asdict(cfg)))
        dist.barrier()
        (self.run_dir / f"pid-rank{self.rank}").write_text(str(os.getpid()))  # for operators and crash tests
        model_dir = cfg.model.path or str(self.run_dir / "model")
        if self.rank == 0 and cfg.model.path is None:  # the visual task needs the tiny vision-language model
            build = build_tiny_vlm if cfg.data.source in ("visual_count", "visual_colour") else build_tiny_model
            build(model_dir, seed=cfg.train.seed, dtype=cfg.model.dtype)
        dist.barrier()
        self.model_dir = model_dir
        # rendered to token ids once, here; logs what it drops; refuses rows with an empty value the run reads
        self.prompts = load_prompts(cfg.data, model_dir, required_columns=self._required_columns())
        # each reward function imported and called on the first prompt now, before the model, the warm start, the
        # weight channel or any worker: a broken reward fails in seconds, naming itself
        try_rewards(cfg.rollout.worker.reward, self.prompts[0], key="rollout.worker.reward",
                    origin=f"{self.prompts.origin}, the first prompt", answer_column=cfg.data.answer_column)
        self.step, self.version = 0, 0
        if cfg.lora.rank and cfg.train.sft_steps:
            self._warm_base_for_lora()
        self._build_model(lora=bool(cfg.lora.rank))
        self.checkpointer = Checkpointer(self.ckpt_dir, self.model, self.optimizer, keep=cfg.checkpoint.keep,
                                         hook=self._save_fault, base=self.base_ref)  # QLoRA: adapter + base's hash
        latest = self.checkpointer.resolve() if self.resume else None
        if latest is not None:  # model, optimizer, RNG now; the loader's state once it exists
            resumed = self.checkpointer.load(latest)
            self.step, self.version = resumed.step, resumed.policy_version
            if self.rank == 0:
                print(f"resumed from {latest} at step {self.step}, policy version {self.version}", file=sys.stderr)
            continue_records(record_files(self.run_dir, self.rank, self.world), self.step, who=f"[rank {self.rank}] ")
        elif cfg.train.sft_steps and not cfg.lora.rank:
            self._sft_warmup()
        self.reference = None if cfg.loss.beta == 0 else ReferencePolicy.for_run(  # the KL's frozen initial policy
            self.model, self.policy, model_dir=self.model_dir, run_dir=self.run_dir, lora=bool(cfg.lora.rank),
            warmed=bool(cfg.train.sft_steps), fresh=latest is None, dtype=cfg.model.dtype, device=self.device,
            parallel=cfg.train.parallel)  # FSDP2: sharded like the policy
        cfg.loss.max_completion_length = cfg.loss.max_completion_length or cfg.rollout.worker.engine.max_new_tokens
        self._start_weight_sync()
        self._build_loader()
        self.checkpointer.loader = self.loader
        if latest is not None:
            self.checkpointer.load_loader(latest)
        mode = "ab" if latest is not None else "wb"  # a fresh run in an old run_dir starts its logs over
        self.metrics_file = open(self.run_dir / "metrics.jsonl", mode) if self.rank == 0 else None
        self.consumed_file = open(self.run_dir / f"consumed-rank{self.rank}.jsonl", mode)
        # what the run says about itself: readable samples (every rank), the guard's verdicts, trackers (rank 0)
        self.launch_from = self.step  # this launch's steps are the later ones: the summary judges those
        self.guard_watch = GuardWatch(config=to_dict(cfg))
        self.samples = SampleLog(self.run_dir, self.rank, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                                 every=cfg.debug.samples_every, per_step=cfg.debug.samples_per_step,
                                 last_step=cfg.train.steps, append=latest is not None)
        self.step_samples: list[dict[str, Any]] = []
        self.trackers = Trackers.open(cfg.report_to if self.rank == 0 else [], cfg.tracking, run_dir=self.run_dir,
                                      config=to_dict(cfg), resume_step=self.step if latest is not None else None)
        self.debugger = None
        if cfg.debug.enabled:
            engine = cfg.rollout.worker.engine
            context = {
                "model_dir": str(Path(self.model_dir).resolve()),
                "sampling": {"temperature": engine.temperature, "top_k": engine.top_k, "top_p": engine.top_p},
                "loss_config": dataclasses.asdict(cfg.loss),
                "checkpoint_dir": str(self.ckpt_dir.resolve()),
                "lora_rank": cfg.lora.rank,
            }
            self.debugger = Debugger(self.run_dir, self.rank, cfg.debug, max_staleness=cfg.rollout.max_staleness,
                                     context=context, append=latest is not None, samples=self.samples)

    def _required_columns(self) -> dict[str, str]:
        """The data columns this run reads besides the prompt, each with who reads it: the reward functions'
        required arguments, and the warm start's answers."""
        cfg = self.cfg
        columns = {} if cfg.rollout.worker.environment else reward_columns(cfg.rollout.worker.reward)
        if cfg.train.sft_steps:
            columns[cfg.data.answer_column] = f"the supervised warm start (train.sft_steps={cfg.train.sft_steps})"
        return columns

    def _warm_base_for_lora(self) -> None:
        """LoRA trains an adapter on a frozen base, so the supervised warm start trains the base first and
        saves it: workers load that directory, and only adapters cross the wire afterwards."""
        sft_dir = self.run_dir / "model-sft"
        if not (sft_dir / "config.json").exists():
            self._build_model(lora=False)
            self._sft_warmup()
            if self.rank == 0:
                self.policy.save_pretrained(sft_dir)
                self.tokenizer.save_pretrained(sft_dir)
            dist.barrier()
        self.model_dir = str(sft_dir)

    def _build_model(self, lora: bool = False) -> None:
        from transformers import AutoTokenizer

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.processor = load_processor(self.model_dir)  # a vision-language model's: image prompts' pixel inputs
        self.base_ref = None
        if lora and cfg.lora.qlora:  # the 4-bit base, loaded as every HF engine loads it (asyncrl.models.qlora)
            from asyncrl.models.qlora import base_reference, load_quantized_base

            policy = load_quantized_base(self.model_dir, dtype=cfg.model.dtype, device=self.device)
            self.base_ref = base_reference(policy, self.model_dir)
        else:
            policy = load_causal_lm(self.model_dir, getattr(torch, cfg.model.dtype))
        policy.generation_config.top_k = None  # the trainer never samples; keep the config neutral
        if lora:
            from peft import LoraConfig, get_peft_model

            self.peft_config = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules)
            policy = get_peft_model(policy, self.peft_config)
            if self.rank == 0:  # what LoRA vs QLoRA hold (asyncrl.models.qlora.parameter_bytes)
                from asyncrl.models.qlora import parameter_bytes

                print(f"policy parameter bytes ({'qlora' if cfg.lora.qlora else 'lora'}): {parameter_bytes(policy)}",
                      file=sys.stderr, flush=True)
        self.policy = policy.to(self.device)
        self.model = parallelize(self.policy, cfg.train.parallel, self.device)  # DDP replicas or FSDP2 shards
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.guard = UpdateGuard(self.model, self.optimizer, cfg.guard, grad_clip=cfg.train.grad_clip)

    def _sft_warmup(self) -> None:
        """Brief supervised steps on the answers, so the policy starts with some reward signal."""
        cfg = self.cfg.train
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.sft_lr)
        gen = torch.Generator().manual_seed(cfg.seed + 1000 * self.rank)
        for _ in range(cfg.sft_steps):
            idx = torch.randint(len(self.prompts), (cfg.sft_batch,), generator=gen).tolist()
            # prompt ids + answer tokens + eos; the loss masks the prompt by its tokens, not its characters
            ids, labels = sft_batch([self.prompts[i] for i in idx], self.tokenizer, self.cfg.data.answer_column)
            images = self._images([self.prompts[i].get("images", []) for i in idx])
            loss = self.model(input_ids=ids.to(self.device), labels=labels.to(self.device), **images).loss
            opt.zero_grad()
            loss.backward()
            opt.step()

    def _images(self, images: list[list[bytes]] | None) -> dict[str, torch.Tensor]:
        """The model's pixel inputs for rows' image bytes (re-run processor, asyncrl.data.images); {} for text rows."""
        return processor_inputs(self.processor, images, device=self.device, dtype=self.policy.dtype) if images else {}

    def _start_weight_sync(self) -> None:
        # this start (or resume) of the run is a new incarnation: its weights and its pools' timeline say so,
        # so rollouts of a rolled-back incarnation's reused version numbers are never trained
        incarnation = [new_incarnation()]
        dist.broadcast_object_list(incarnation, src=0)
        self.incarnation = incarnation[0]
        # rank 0's broadcaster (zmq: with the rollout channel's CURVE keys and allow-list); every rank its address
        self.weight_sync = start_weight_sync(self.cfg.weights, run_dir=self.run_dir, device=self.device,
                                             security=self.cfg.rollout.transport)
        self.broadcaster, self.weights_address = self.weight_sync.broadcaster, self.weight_sync.address

    def _build_loader(self) -> None:
        cfg = self.cfg
        worker = dataclasses.replace(
            cfg.rollout.worker,
            testing=cfg.testing,  # the workers' injected faults (tests only)
            weights=dataclasses.replace(cfg.weights, address=self.weights_address),
            engine=dataclasses.replace(cfg.rollout.worker.engine, model=self.model_dir, lora_rank=cfg.lora.rank,
                                       dtype=cfg.model.dtype, **({"quantization": "nf4"} if cfg.lora.qlora else {})),
        )
        self.reward_weights = reward_weights(worker.reward)  # loss.multi_objective_aggregation: normalize_then_sum
        # the gate refuses token ids outside the model's vocabulary (a forged or broken worker's)
        gate = dataclasses.replace(cfg.rollout.gate, vocab_size=cfg.rollout.gate.vocab_size or self.policy.config.get_text_config().vocab_size)
        loader_cfg = dataclasses.replace(cfg.rollout, worker=worker, drop_remainder=True, gate=gate)
        self.loader = RolloutLoader(self.prompts, loader_cfg, incarnation=self.incarnation, config_key="rollout")
        # the one owner of the policy version; publishes the current one: workers start from the trainer's weights
        self.sync = PolicySync(self.model, self.loader, self.broadcaster, version=self.version,
                               mode="lora" if cfg.lora.rank else "full", bucket_bytes=cfg.weights.bucket_bytes)
        if cfg.cluster.engine != "local":  # launched on a cluster: workers find this pool by its record
            write_pool_record(self.run_dir, pool_record(
                rank=self.rank, world_size=self.world, incarnation=self.incarnation,
                endpoint=self.loader.endpoints[self.rank], transport=to_dict(loader_cfg.transport), worker=to_dict(worker),
                weights={"type": cfg.weights.type, "address": self.weights_address, "delta": cfg.weights.delta}))
        if self.rank == 0 and not loader_cfg.num_workers:  # remote workers: tell the operator where to point them
            connect = " ".join(f"--connect {e}" for e in self.loader.endpoints)
            print(f"start workers with: asyncrl worker {connect} --set worker.weights.type={cfg.weights.type} "
                  f"--set worker.weights.address={self.weights_address} --set worker.engine.type=<hf|vllm> "
                  f"--set worker.engine.model=<dir>", file=sys.stderr, flush=True)

    # -- train -------------------------------------------------------------------------------------------------------
    def train(self) -> None:
        from tqdm import tqdm

        cfg = self.cfg
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=self.rank != 0, desc="grpo", unit="step")
        t_last = time.perf_counter()
        while self.step < cfg.train.steps:
            for batch in self.loader:
                wait_s = time.perf_counter() - t_last  # blocked on the loader: the trainer's idle time
                record = self.train_step(batch)
                now = time.perf_counter()
                record["step_s"] = now - t_last
                record["wait_s"] = wait_s
                t_last = now
                self._log(record, batch)
                said = self.guard_watch.observe(self.step, record["accepted"], record["guard_reason"])
                if said and self.rank == 0:
                    bar.write(said, file=sys.stderr)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", stale=f"{record['staleness_mean']:.2f}",
                                rollouts_s=f"{record['rollouts_per_s']:.0f}", **self.guard_watch.postfix())
                bar.update()
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save_checkpoint()
                if cfg.testing.pause_after_step == self.step:
                    time.sleep(3600)
                time.sleep(cfg.testing.step_delay_s)
                if self.step >= cfg.train.steps:
                    break
        bar.close()
        self.save_checkpoint()

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        self.step += 1
        rewards = batch["rewards"]
        staleness = (self.version - batch["policy_versions"]).float()  # at consumption, before this update
        if cfg.testing.inject_nan_at_step == self.step:
            rewards = torch.full_like(rewards, float("nan"))
        dev = lambda t: t.to(self.device)
        ids, attn, mask = dev(batch["input_ids"]), dev(batch["attention_mask"]), dev(batch["loss_mask"])
        engine = cfg.rollout.worker.engine  # the batch says what its rollouts were sampled with; it must be this
        sampling = batch_sampling(batch, expected={"temperature": engine.temperature, "top_k": engine.top_k,
                                                   "top_p": engine.top_p})
        t0 = time.perf_counter()
        logp = token_logprobs(self.model, ids, attn, **sampling, grad=True, images=self._images(batch.get("images")),
                              suppress_token_ids=vision_token_ids(self.processor))  # what a VLM's engines never sample
        ref = (None if self.reference is None else  # loss.beta > 0: the frozen reference's logprobs, for the KL
               self.reference.logprobs(ids, attn, **sampling))
        loss, loss_metrics, advantages = compute_loss(  # advantages, then the loss_type's loss or the user's loss.fn
            {**batch, "rewards": rewards}, logp, config=cfg.loss, trainer_version=self.version, ref_logprobs=ref,
            all_reduce=all_reduce_sum, reward_weights=self.reward_weights)
        self.optimizer.zero_grad(set_to_none=True)  # the warm start's optimizer leaves its last gradients
        lr = cfg.train.lr * min(1.0, self.step / max(1, cfg.train.warmup_steps))
        verdict = self.guard.step(loss, lr=lr)  # backward, clip, step; a rejected update is undone exactly
        accepted, reason, grad_norm, ratio = verdict.accepted, verdict.reason, verdict.grad_norm, verdict.update_ratio
        consumed_version = self.version
        # before the publish: rollouts the gate rejects from here on were made with the new weights (next step's)
        transport = (self.loader.stats()["transport"] | {"rejected_rollouts": self.loader.rejected_rollouts()}
                     if self.debugger is not None else None)
        # the batch fed this step is committed, accepted or not; the pool's version moves before the publish
        published = self.sync.commit(accepted)
        self.version, weight_bytes, publish_s = published.policy_version, published.weight_bytes, published.publish_s
        # after the publish (the workers generate meanwhile): metrics only, nothing the verdict or the weights use
        mismatch = mismatch_metrics(logp.detach(), dev(batch["rollout_logprobs"]), mask)
        if not accepted and self.debugger is None:  # with the debugger on, a rejection is one of its anomalies (and dumps)
            write_rejected_batch(self.run_dir, step=self.step, rank=self.rank, policy_version=self.version,
                                 verdict=verdict, batch=batch, rewards=rewards)
        if self.debugger is not None:
            record = self.debugger.observe(
                step=self.step, policy_version=consumed_version, batch=batch, rewards=rewards,
                trainer_logprobs=logp.detach(), advantages=advantages, accepted=accepted, guard_reason=reason,
                loss=float(loss.detach()), grad_norm=grad_norm, update_ratio=ratio, weight_bytes=weight_bytes,
                publish_s=publish_s, transport=transport, weights=lambda: self.guard.snapshot,
            )
            for a in record["anomalies"]:
                print(f"[rank {self.rank}] step {self.step}: anomaly {a['kind']}: {a['detail']}"
                      + (f" (batch dumped to {self.run_dir / a['dump']})" if a["dump"] else ""), file=sys.stderr)
        # readable rollouts: every debug.samples_every steps (an anomaly's batch was written whole just above)
        self.step_samples = self.samples.write(self.step, batch, trainer_version=consumed_version, rewards=rewards,
                                               advantages=advantages, accepted=accepted) if self.samples.due(self.step) else []
        logged = global_metrics({**{f"loss/{k}": v for k, v in loss_metrics.items()},  # over every rank's tokens
                                 **{f"mismatch/{k}": v for k, v in mismatch.items()}}, self.device)
        return {
            "step": self.step, "policy_version": self.version, "accepted": accepted, "guard_reason": reason,
            "loss": logged["loss/loss"], "grad_norm": grad_norm, "update_ratio": ratio,
            **batch_stats(rewards, staleness, batch["num_tokens"], self.device),  # over all ranks
            "weight_bytes": weight_bytes, "publish_s": publish_s, "train_s": time.perf_counter() - t0 - publish_s,
            **logged,
            **({"kl": logged["loss/kl"]} if "loss/kl" in logged else {}),  # loss.beta > 0 (TRL's name)
            # each reward function's unweighted mean over all ranks (TRL's rewards/<name>/mean)
            **{f"rewards/{k}/mean": v for k, v in component_means(batch.get("reward_components", {})).items()},
        }

    def _log(self, record: dict[str, Any], batch: dict[str, Any]) -> None:
        record["rollouts_per_s"] = len(batch["uids"]) * self.world / max(record["step_s"], 1e-9)
        self.consumed_file.write(dumps_json({"step": self.step, "group_ids": batch["group_ids"],
                                             "workers": sorted(set(batch["worker_ids"]))}) + b"\n")
        self.consumed_file.flush()
        if self.metrics_file is not None:
            record["time"] = time.time()
            record["pipeline"] = pipeline_counters(self.loader, self.broadcaster)
            self.metrics_file.write(dumps_json(record) + b"\n")
            self.metrics_file.flush()
            self.trackers.log_step(self.step, record)  # report_to: the same numbers, the guard's verdict
            self.trackers.log_samples(self.step, self.step_samples)

    # -- checkpoint --------------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """One complete checkpoint (asyncrl.checkpoint.Checkpointer: model + optimizer via DCP, each rank's loader
        state, RNG, step, policy version, and the config); a step already on disk is not saved again."""
        self.checkpointer.save(self.step, self.version, files={"config.json": dumps_json(dataclasses.asdict(self.cfg))})

    def _save_fault(self, point: str, step: int) -> None:
        """Fault injection (``testing.pause_in_save_at_step``): rank 0 sleeps at one point of one save."""
        testing = self.cfg.testing
        if step == testing.pause_in_save_at_step and point == testing.pause_in_save_point:
            print(f"[rank {self.rank}] pausing in the save of step {step} after {point!r} "
                  f"(testing.pause_in_save_at_step)", file=sys.stderr, flush=True)
            time.sleep(3600)

    # -- the end of the run ------------------------------------------------------------------------------------------
    def _summarize(self, failed: str | None = None) -> str | None:
        """Rank 0: ``summary.json``, the trackers' summary and end; returns the text to print last (None when there is
        nothing to summarise: no step was logged). ``failed``: the error a failed run ends with (its trackers' runs end
        as failed)."""
        outputs = {f"tracker {name}": where for name, where in self.trackers.locations().items()}
        if self.cfg.debug.report:
            outputs["report"] = str(self.run_dir / "report" / "index.html")
        try:
            summary = run_summary(self.run_dir, launch_from_step=self.launch_from, outputs=outputs, failed=failed)
        except ValueError:  # no metrics.jsonl: nothing ran (the run's own error is what the user must see)
            self.trackers.close(ok=False)
            return None
        if not summary["steps"]["total"]:
            self.trackers.close(ok=False)
            return None
        write_summary(self.run_dir, summary)
        text = format_summary(summary)
        self.trackers.log_summary(summary, text)
        self.trackers.close(ok=failed is None and summary["verdict"] != "every update rejected")
        return text

    def every_update_rejected(self) -> bool:
        """This launch trained steps and the guard rejected each of their updates (the same verdicts on every rank)."""
        return self.guard_watch.rejected > 0 and self.guard_watch.accepted == 0

    # -- cleanup -----------------------------------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Closes everything after a run that ended well; rank 0 writes the end-of-run summary (``summary.json``, the
        trackers), the report, and prints the summary last. A failed run leaves through :meth:`abort` instead."""
        self.loader.close()
        if self.debugger is not None:
            self.debugger.close()
        self.weight_sync.close()  # rank 0: the broadcaster (and the shm directory)
        self.consumed_file.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
            text = self._summarize()
            if self.cfg.debug.report:
                plot(self.run_dir)
                from asyncrl.debug.report import write_report

                print(f"report: {write_report(self.run_dir)}", file=sys.stderr)
            if text:
                print(text, file=sys.stderr, flush=True)
        dist.barrier()
        dist.destroy_process_group()
        if self.run_lock is not None:  # last: the run directory is this run's until everything above is written
            self.run_lock.release()

    def abort(self, error: BaseException) -> None:
        """A failed run: one line naming this rank and the error, then whatever was started is closed (the workers,
        the weight channel and its shared memory, the run-directory lock), each step on its own so that none of them
        hides the error. Rank 0 of a run that logged steps writes and prints the summary of what it did until then
        (``summary.json``, marked failed; the trackers' runs end as failed); nothing is plotted or reported."""
        rank = getattr(self, "rank", os.environ.get("RANK", "?"))
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"[rank {rank}] grpo failed: {type(error).__name__}: {first}", file=sys.stderr, flush=True)
        for name, close in (("loader", lambda: self.loader.close()), ("debugger", lambda: self.debugger.close()),
                            ("weight_sync", lambda: self.weight_sync.close()),
                            ("consumed_file", lambda: self.consumed_file.close()),
                            ("metrics_file", lambda: self.metrics_file.close()),
                            ("trackers", lambda: self._failed_summary(f"{type(error).__name__}: {first}")),
                            ("run_lock", lambda: self.run_lock.release())):
            if getattr(self, name, None) is None:
                continue
            try:
                close()
            except Exception as e:  # deliberate: the run's own error is the one to report; this one is secondary
                print(f"[rank {rank}] (while closing {name} after the failure: {type(e).__name__}: {e})",
                      file=sys.stderr)


    def _failed_summary(self, failed: str) -> None:
        """Rank 0 (which kept the metrics): the failed run's summary, written and printed; other ranks end their
        trackers (none: trackers are rank 0's)."""
        if getattr(self, "metrics_file", None) is None:
            self.trackers.close(ok=False)
            return
        text = self._summarize(failed)
        if text:
            print(text, file=sys.stderr, flush=True)


def _import_path(run_file: str | None) -> None:
    """``module:function`` names (rewards, losses) are found in the working directory and the run file's directory
    too, in this rank and in its local workers (which get the directory a reward module came from on their
    ``PYTHONPATH``: asyncrl.rewards.preflight)."""
    for directory in (os.getcwd(), str(Path(run_file).resolve().parent) if run_file else None):
        if directory and directory not in sys.path:
            sys.path.append(directory)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's command line: ``--config FILE``, ``--resume``, then dotted overrides."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run file (recipes/configs/*.yaml)")
    p.add_argument("--resume", action="store_true", help="continue from run_dir/checkpoints/latest if present")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_staleness=0 train.steps=50")
    return p.parse_args(argv)


@record  # torchrun's summary names the first failing rank with its exception (torch.distributed.elastic)
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = load_config(args.config, args.overrides)
    if cfg.model.path is not None:  # asyncrl's own message, before anything loads it
        check_model_dir(cfg.model.path, key="model.path")
    _import_path(args.config)
    os.environ.update(worker_env(cfg.rollout.worker.reward))  # before the prestart: the workers import them too
    resolve_report_to(cfg.report_to)  # a tracker that is not installed: refused before any process starts
    RolloutLoader.prestart_workers(cfg.rollout)  # the local workers' imports overlap this rank's whole set-up
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(cfg.train.threads or trainer_threads(local_ranks, local_ranks * cfg.rollout.num_workers))
    # torchrun ends the other ranks with SIGTERM when one fails: leave through abort() (workers, shared memory)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    recipe = GRPORecipe(cfg, resume=args.resume)
    try:
        recipe.setup()
        recipe.train()
    except BaseException as e:
        recipe.abort(e)
        raise
    recipe.cleanup()
    if recipe.every_update_rejected():  # the summary said why, loudly; the exit status says it to scripts
        raise SystemExit(f"[rank {recipe.rank}] every one of the {recipe.guard_watch.rejected} updates of this run was "
                         "rejected by the update guard: the policy did not train (see the run summary above)")


if __name__ == "__main__":
    # the imports are done (with the model classes set-up imports lazily): collect once, freeze what they built
    freeze_import_heap("transformers.modeling_utils", "transformers.generation.utils")
    main()

"""Driver for test_lightning: a PyTorch Lightning run whose ``train_dataloader`` is a RolloutLoader.

Each trained batch appends ``{"step", "version", "group_ids", "policy_versions"}`` to ``DIR/trained.jsonl``
(flushed per step). ``--pause-after STEP`` sleeps after that step so the test can SIGKILL the process;
``--resume`` continues from the newest checkpoint in ``DIR/ckpt`` with ``fit(ckpt_path=...)``. ``--own-sync`` is
the loop of a user who read nothing: the loader built with the default ``prefetch=0``, no ``RolloutSync``, the
module itself telling the loader each new version.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.integrations.lightning import RolloutSync


class Policy(pl.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.log_file = open(Path(args.dir) / "trained.jsonl", "a")

    def train_dataloader(self) -> RolloutLoader:
        config = LoaderConfig(
            group_size=2, batch_size=4, capacity=16, max_staleness=1, prefetch=0 if self.args.own_sync else 1,
            num_workers=1, ordered=False,
            lease_timeout_s=30, wait_timeout_s=120, poll_timeout_s=0.2,
            transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=2.0),
            worker=WorkerConfig(slots=4, max_batch=2,
                                engine=FakeEngineConfig(max_new_tokens=8, seconds_per_token=0.001)),
        )
        prompts = [{"prompt_ids": [i % 200 + 1, 5]} for i in range(self.args.prompts)]
        self.loader = RolloutLoader(prompts, config)
        return self.loader

    def training_step(self, batch, batch_idx):
        record = {"step": self.global_step + 1, "version": self.loader.policy_version,
                  "group_ids": batch["group_ids"], "policy_versions": batch["policy_versions"].tolist()}
        self.log_file.write(json.dumps(record) + "\n")
        self.log_file.flush()
        return (self.scale * batch["rewards"].float()).mean() ** 2

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.args.own_sync:
            self.loader.set_policy_version(self.global_step)
        if self.args.pause_after == self.global_step:
            time.sleep(3600)  # killed here by the test

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_fit_end(self):
        self.loader.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--pause-after", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--own-sync", action="store_true")
    args = p.parse_args()
    ckpt_dir = Path(args.dir) / "ckpt"
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.every, save_top_k=-1)
    trainer = pl.Trainer(max_steps=args.max_steps, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[checkpoint] if args.own_sync else [RolloutSync(), checkpoint])
    ckpt = None
    if args.resume:
        ckpt = str(max(ckpt_dir.glob("*.ckpt"), key=lambda q: torch.load(q, weights_only=False)["global_step"]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trainer.fit(Policy(args), ckpt_path=ckpt)


if __name__ == "__main__":
    main()

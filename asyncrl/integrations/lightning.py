"""PyTorch Lightning integration: a :class:`~asyncrl.RolloutLoader` as a ``train_dataloader`` that resumes
exactly once.

::

    class Policy(L.LightningModule):
        def train_dataloader(self):
            return RolloutLoader(prompts, config, prefetch=1)     # Lightning fetches one batch ahead
        def training_step(self, batch, batch_idx): ...

    trainer = L.Trainer(max_steps=N, callbacks=[RolloutSync(), ModelCheckpoint(every_n_train_steps=k)])
    trainer.fit(Policy(), ckpt_path="last")                      # resumes ledger, pool and buffered rollouts

What Lightning does, and what makes it exact:

* Lightning fetches the next batch before it trains the current one (``_PrefetchDataFetcher``, one batch), so
  the loader is built with ``prefetch=1``: a yielded batch counts as consumed only when the update it fed is
  committed, and staleness is judged at the version it is trained at (one more than when it was taken).
* :class:`RolloutSync` commits after every optimizer step: ``on_train_batch_end`` calls
  ``loader.set_policy_version(trainer.global_step)``, then an optional ``publish(version)`` sends the new
  weights to the workers. Lightning runs ``ModelCheckpoint`` after every other callback, so the loader
  state it saves has this batch committed and the prefetched one saved for re-delivery.
* Lightning saves ``loader.state_dict()`` in the checkpoint (the loader is ``_Stateful``) and loads it
  before its first ``iter()``; the ``iter()`` it makes to check the loader yields nothing and does not
  advance the epoch.

``lightning`` is an optional dependency (the ``test`` extra installs it); importing this module without it
raises ``ImportError`` naming the package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as e:  # optional dependency
    raise ImportError("asyncrl.integrations.lightning needs the `lightning` package: pip install 'lightning>=2.4'"
                      ) from e

from datapipes.loader import RolloutLoader

__all__ = ["RolloutSync"]


class RolloutSync(pl.Callback):
    """Tells the train loader's pipeline about each committed update (Lightning's ``global_step``).

    Args:
        publish: optional ``version -> None`` called with each new version (e.g. a weight broadcaster's
            ``publish(model.state_dict(), version, incarnation=loader.incarnation)``), on global rank 0.

    Raises:
        TypeError: at fit start, if the train dataloader is not a :class:`~asyncrl.RolloutLoader`.
        ValueError: at fit start, if the loader does not account for Lightning's one-batch prefetch.
    """

    def __init__(self, publish: Callable[[int], None] | None = None):
        self.publish = publish

    @staticmethod
    def _loader(trainer: pl.Trainer) -> RolloutLoader:
        loader = trainer.train_dataloader
        if not isinstance(loader, RolloutLoader):
            raise TypeError(f"RolloutSync needs a RolloutLoader as train_dataloader, got {type(loader).__name__}")
        return loader

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = self._loader(trainer)
        if loader.config.prefetch < 1:
            raise ValueError(
                f"the RolloutLoader has prefetch={loader.config.prefetch}, but Lightning fetches one batch ahead of "
                "the one it trains: build it with prefetch=1 (and max_staleness >= 1), or a checkpoint would count "
                "the prefetched batch as consumed"
            )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loader = self._loader(trainer)
        version = max(trainer.global_step, loader.policy_version)
        new = version > loader.policy_version
        loader.set_policy_version(version)  # first: no worker may hold weights newer than its pool's trainer
        if self.publish is not None and trainer.is_global_zero and new:
            self.publish(version)

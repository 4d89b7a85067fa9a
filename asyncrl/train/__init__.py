"""The trainer's side of a step: what a training loop calls between ``next(loader)`` and the next batch.

::

    logprobs.py      trainer-side token logprobs under the distribution the engines sampled from
    advantages.py    GRPO advantages (group / batch / none scaling, multi-objective)
    surrogates.py    the policy-loss surrogates by ``loss.loss_type``, one registry
    corrections.py   off-policy corrections of the train/inference mismatch, version masks, mismatch metrics
    losses.py        compute_loss / policy_loss: advantages -> surrogate -> aggregation (+ KL, user losses)
    reference.py     the frozen reference policy of the KL penalty
    guard.py         UpdateGuard: an optimizer step taken only if sane, undone exactly if not
    optim.py         the AdamW the recipe uses
    parallel.py      DDP replicas or FSDP2 shards
    policy_sync.py   PolicySync: the one owner of the policy version (pool version, then publish)
    step_metrics.py  what a step logs, over all ranks
    threads.py       intra-op threads of a rank that shares cores with local workers

Import from the modules (``asyncrl.train.losses``, ...); the public names are re-exported by :mod:`asyncrl`.
"""

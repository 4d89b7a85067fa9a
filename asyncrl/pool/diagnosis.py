"""Why no group came: a trainer's wait that timed out (``wait_timeout_s``), explained from what the pool and the rollout
channel counted while it waited.

::

    RolloutPoolNode.next() ── waits ──► snapshot() at the start, snapshot() at the timeout ──► explain(before, after)
                                          pool stats, ledger counters,                        the first cause that
                                          channel counters and each worker's status            fits, then the figures

The causes, in the order they are tried (the first that fits leads the message, the figures follow):

- no worker is connected (none started, or every one died: their stderr is above);
- groups arrived and were dropped as stale: the workers' policy versions against the trainer's, and the fix (a weight
  channel the trainer publishes to, or a larger ``max_staleness``);
- rollouts refused as off the trainer's timeline (weights newer than the trainer, a rolled-back incarnation);
- leases failed in the workers (the last error);
- groups refused by the gate (the last reason);
- the pool leased nothing (its reason: the staleness window, capacity, nothing left);
- workers hold leases and finished none: generation slower than the timeout.

Pure functions over plain dicts; nothing here blocks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["explain", "snapshot"]


def snapshot(pool: Any, receiver: Any) -> dict[str, Any]:
    """The counters :func:`explain` compares: the pool's stats, its ledger's counters and last failures, the channel's
    counters and workers (taken under the pool's lock, then the channel's)."""
    with pool.cond:
        out = {"pool": dict(pool.stats), "ledger": dict(pool.ledger.counters), "withheld": pool.withheld,
               "leases": len(pool.ledger.leases), "failures": dict(pool.ledger.failures()),
               "policy_version": pool.policy_version}
    out["transport"] = receiver.stats()
    return out


def _delta(before: dict[str, Any], after: dict[str, Any], section: str, key: str) -> int:
    return int(after[section].get(key, 0) - before[section].get(key, 0))


def explain(before: dict[str, Any], after: dict[str, Any], *, waited_s: float, max_staleness: int | None,
            endpoint: str, key: str = "LoaderConfig") -> str:
    """Why no group came between two :func:`snapshot`\\ s, as one message: the cause, the fix, then the figures.

    Args:
        before: the snapshot when the wait started.
        after: the snapshot when it timed out.
        waited_s: how long it waited.
        max_staleness: the loader's.
        endpoint: the pool's address (for workers to connect to).
        key: how the loader's settings are named (``LoaderConfig``, or a run file's ``rollout``).
    """
    workers: dict[str, dict[str, Any]] = after["transport"].get("workers", {}) or {}
    trainer = after["policy_version"]
    received = _delta(before, after, "pool", "groups_received")
    stale = _delta(before, after, "pool", "stale_dropped")
    off_timeline = {k: _delta(before, after, "pool", k) for k in ("ahead_of_trainer", "dead_timeline")}
    failed = _delta(before, after, "ledger", "lease_failures")
    refused = _delta(before, after, "transport", "groups_refused")
    granted = _delta(before, after, "transport", "leases_granted")
    versions = sorted({w["policy_version"] for w in workers.values() if isinstance(w.get("policy_version"), int)})
    wait = f"no rollout group for {waited_s:.0f} s ({key}.wait_timeout_s)"
    if not workers:
        cause = (f"{wait}: no rollout worker is connected to this pool ({endpoint}). Local workers that died are named "
                 f"in the messages above; with {key}.num_workers=0 start workers with `asyncrl worker --connect "
                 f"{endpoint}`")
    elif stale:
        cause = (f"{wait}: {received} groups arrived and {stale} were dropped as stale: workers at policy version"
                 f"{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions)) or '?'}, trainer at {trainer} "
                 f"({key}.max_staleness={max_staleness}). The workers are not getting the trainer's weights: give them "
                 f"a weight channel ({key}.worker.weights, published to by PolicySync), or raise {key}.max_staleness")
    elif any(off_timeline.values()):
        parts = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in off_timeline.items() if n)
        cause = (f"{wait}: rollouts arrived off the trainer's timeline ({parts}): publish weights only after "
                 "set_policy_version (PolicySync.commit does both, in order) and with incarnation=loader.incarnation")
    elif failed:
        last = next(reversed(after["failures"].values()), (0, ""))[1] if after["failures"] else ""
        cause = (f"{wait}: {failed} leases failed in the workers; the last error: {last[:500]}")
    elif refused:
        errors = after["transport"].get("recent_errors") or []
        cause = (f"{wait}: {refused} groups were refused by the pool's gate; the last reason: "
                 f"{errors[-1] if errors else '?'}")
    elif not granted and not after["leases"]:
        cause = (f"{wait}: the pool leased nothing to its {len(workers)} connected workers (the reason it withheld "
                 f"credits: {after['withheld'] or 'none recorded'}); every prompt of the epoch may be delivered and "
                 "waiting for its update to be committed (set_policy_version / commit)")
    else:
        cause = (f"{wait}: {len(workers)} workers are connected and hold {after['leases']} leases, but none finished "
                 f"a group: generation may take longer than that (raise {key}.wait_timeout_s, or set it to None)")
    figures = {"groups_received": received, "stale_dropped": stale, "leases_failed": failed,
               "groups_refused": refused, "leases_granted": granted, "leases_held": after["leases"],
               "trainer_version": trainer, "worker_versions": {w: s.get("policy_version") for w, s in workers.items()}}
    return f"{cause}. While waiting: {figures}"

"""A reward function that raises on one prompt, in a real worker process behind a real pool: that prompt's leases
come back FAILED (counted, the error in ``loader.stats()``), its batch-mates are trained, the worker keeps
serving (never restarted), and the epoch ends with every other group consumed exactly once."""

from __future__ import annotations

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.config import RewardConfig
from asyncrl.rollout import make_group_id

pytestmark = pytest.mark.integration

PROMPTS = 12
BAD = 5  # its index in the dataset
MAX_FAILURES = 2


def fails_on_the_bad_prompt(prompts, completions, boom=None, **kwargs):
    """A batched reward: 0.5 for every completion, unless the batch holds the bad prompt (column ``boom``)."""
    if boom is not None and any(boom):
        raise RuntimeError("boom: this judge cannot score the bad prompt")
    return [0.5] * len(completions)


def test_a_raising_reward_fails_only_its_prompt_and_the_worker_keeps_serving():
    prompts = [{"prompt_ids": [1 + i, 2, 3], **({"boom": True} if i == BAD else {})} for i in range(PROMPTS)]
    reward = RewardConfig(funcs=["tests.integration.test_reward_failures:fails_on_the_bad_prompt", "fake"],
                          weights=[1.0, 0.0])
    config = LoaderConfig(
        group_size=2, batch_size=2, capacity=8, max_staleness=None, num_workers=1,
        max_prompt_failures=MAX_FAILURES, on_poisoned_prompt="skip", prompt_failure_backoff_s=0.05,
        wait_timeout_s=60, transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=5),
        worker=WorkerConfig(slots=4, max_batch=4, reward=reward, engine=FakeEngineConfig(max_new_tokens=4)),
    )
    consumed: list[str] = []
    with RolloutLoader(prompts, config) as loader:
        for step, batch in enumerate(loader):
            consumed += batch["group_ids"]
            assert batch["rewards"].eq(0.5).all()  # 1.0 * 0.5 + 0.0 * fake's
            assert set(batch["reward_components"]) >= {"fails_on_the_bad_prompt", "fake", "even_fraction", "length"}
            loader.set_policy_version(step + 1)
        stats = loader.stats()
    assert sorted(consumed) == sorted(make_group_id(0, i) for i in range(PROMPTS) if i != BAD)  # each once
    assert stats["ledger"]["lease_failures"] == MAX_FAILURES and stats["skipped"] == [BAD]
    failure = stats["prompt_failures"][str(BAD)]
    assert failure["failures"] == MAX_FAILURES
    assert ("reward function 'fails_on_the_bad_prompt' raised RuntimeError: boom: this judge cannot score the bad "
            "prompt") in failure["error"]
    workers = stats["workers"]
    assert workers is not None and workers["deaths"] == [0] and workers["restarts"] == [0], workers

"""A prompt every worker fails on (``{"foo": 1}``: none of ``prompt_ids``, ``messages``, ``prompt``, ``text``), with a real worker
process: the trainer's ``next()`` raises naming the prompt (raise mode) or the epoch ends without it, every
other group consumed exactly once (skip mode); the worker's log stays bounded either way."""

from __future__ import annotations

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.pool.poison import PoisonedPromptError
from asyncrl.rollout import make_group_id

pytestmark = pytest.mark.integration

GOOD = 15
POISONED = 7  # its index in the dataset
MAX_FAILURES = 3
MAX_STDERR_LINES = 150  # a few throttled warnings with their tracebacks (before the fix: ~740 lines a second)


def _prompts() -> list[dict]:
    prompts: list[dict] = [{"prompt_ids": [1 + i, 2, 3]} for i in range(GOOD)]
    prompts.insert(POISONED, {"foo": 1})
    return prompts


def _config(on_poisoned_prompt: str) -> LoaderConfig:
    return LoaderConfig(
        group_size=2,
        batch_size=2,
        capacity=8,
        max_staleness=None,
        num_workers=1,
        max_prompt_failures=MAX_FAILURES,
        on_poisoned_prompt=on_poisoned_prompt,
        prompt_failure_backoff_s=0.05,
        wait_timeout_s=30,  # before the fix the trainer waited here (forever without it)
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=5),
        worker=WorkerConfig(slots=4, max_batch=4, engine=FakeEngineConfig(max_new_tokens=4)),
    )


def _stderr_lines(capfd) -> list[str]:
    return capfd.readouterr().err.splitlines()  # the worker process inherits the test's fd 2


def test_raise_mode_raises_in_next_naming_the_prompt(capfd):
    consumed: list[str] = []
    with RolloutLoader(_prompts(), _config("raise")) as loader:
        with pytest.raises(PoisonedPromptError) as info:
            for step, batch in enumerate(loader):
                consumed += batch["group_ids"]
                loader.set_policy_version(step + 1)
        stats = loader.stats()
    e = info.value
    assert (e.epoch, e.prompt_index, e.failures) == (0, POISONED, MAX_FAILURES)
    assert f"(epoch=0, index={POISONED})" in str(e) and f"{MAX_FAILURES} times" in str(e)
    assert "an engine needs a prompt with" in e.error and "'foo': 1" in str(e)
    # the worker's FAILED report said what failed; the fix is named with the key a library user has
    assert e.culprit == "engine" and "the engine failed to generate for this prompt" in str(e)
    assert "LoaderConfig.on_poisoned_prompt='skip'" in str(e) and "loader.on_poisoned_prompt" not in str(e)
    # bounded attempts: exactly max_prompt_failures leases of it came back FAILED, and no other prompt failed
    assert stats["transport"]["leases_failed"] == MAX_FAILURES
    assert stats["ledger"]["lease_failures"] == MAX_FAILURES
    assert make_group_id(0, POISONED) not in consumed and len(consumed) == len(set(consumed))
    lines = _stderr_lines(capfd)
    assert len(lines) <= MAX_STDERR_LINES, f"{len(lines)} lines of worker log; last: {lines[-5:]}"


def test_skip_mode_ends_the_epoch_with_every_other_group_consumed_exactly_once(capfd):
    consumed: list[str] = []
    with RolloutLoader(_prompts(), _config("skip")) as loader:
        for step, batch in enumerate(loader):  # the epoch ends: the skipped prompt counts as done
            consumed += batch["group_ids"]
            loader.set_policy_version(step + 1)
        stats = loader.stats()
    good = {make_group_id(0, i) for i in range(GOOD + 1) if i != POISONED}
    assert sorted(consumed) == sorted(good)  # each exactly once, the poisoned one never
    assert stats["pool"]["skipped_poisoned"] == 1 and stats["skipped"] == [POISONED]
    assert stats["consumed"] == GOOD  # skipped is not consumed
    assert stats["transport"]["leases_failed"] == MAX_FAILURES
    lines = _stderr_lines(capfd)
    assert len(lines) <= MAX_STDERR_LINES, f"{len(lines)} lines of worker log; last: {lines[-5:]}"

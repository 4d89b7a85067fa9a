"""Reward functions (asyncrl.rewards.reward_set): the built-ins score known right and wrong answers, weighted lists add
up with every component kept, async functions run concurrently on one event loop, and a raising function fails
its group's lease only (the worker keeps serving). In-process, with the fake engine and a fake sender."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch

from asyncrl.config import FakeEngineConfig, RewardConfig, WorkerConfig, from_dict, to_dict
from asyncrl.rewards import UNSCORED, RewardError, RewardSet, format_reward, math_reward, reasoning_gym_reward
from asyncrl.transport import ReceivedLease
from tests.utils import FakeSender
from workers.engines import Completion, build_engine
from workers.worker import RolloutWorker


def _completion(text: str, ids=(5, 6), finish_reason: str = "stop") -> Completion:
    return Completion(prompt_ids=torch.tensor([1]), response_ids=torch.tensor(ids), logprobs=torch.zeros(len(ids)),
                      finish_reason=finish_reason, policy_version=0, text=text)


# ---------------------------------------------------------------------------------------------------------------------
# built-ins


def test_math_verify_scores_right_and_wrong_answers():
    completions = [r"so the answer is $\frac{1}{2}$", r"I get \boxed{0.5}", "It is 3", "no idea"]
    assert math_reward(completions, answer=["0.5", r"\frac{1}{2}", "4", "7"]) == [1.0, 1.0, 0.0, 0.0]
    assert math_reward(["$4$"], answer=["not a number at all"]) == [None]  # reference unparseable: unscored
    chat = [[{"role": "assistant", "content": "$x = 2$"}]]  # TRL's conversational form
    assert math_reward(chat, solution=["2"]) == [1.0]


def test_reasoning_gym_score_answer_scores_right_and_wrong_answers():
    import reasoning_gym

    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=3))
    # the entry as a prompt's columns reach a worker: through msgpack (tuples become lists)
    prompts = [msgpack.unpackb(msgpack.packb({"text": e["question"], "answer": e["answer"],
                                              "metadata": e["metadata"]})) for e in entries]
    right = [f"<think>easy</think><answer>{e['answer']}</answer>" for e in entries]
    wrong = [f"<answer>{int(e['answer']) + 1}</answer>" for e in entries]
    cols = {k: [p[k] for p in prompts] for k in ("answer", "metadata")}
    assert reasoning_gym_reward(right, **cols) == [1.0] * 4
    assert reasoning_gym_reward(wrong, **cols) == [0.0] * 4
    assert reasoning_gym_reward([e["answer"] for e in entries], **cols) == [1.0] * 4  # no tags: the whole text
    with pytest.raises(ValueError, match="source_dataset"):
        reasoning_gym_reward(["1"], metadata=[{}])
    # through a RewardSet, the way the worker calls it: the columns come from the prompt items
    scored = RewardSet.from_config(RewardConfig(funcs=["reasoning_gym", "format"])).score(
        [(p, [_completion(r), _completion(w)]) for p, r, w in zip(prompts, right, wrong)])
    assert [[reward for reward, _ in group] for group in scored] == [[2.0, 0.0]] * 4
    assert scored[0][0][1] == {"reasoning_gym": 1.0, "format": 1.0}


def test_format_reward():
    assert format_reward(["<think>a</think> <answer>1</answer>", "<answer>1</answer>", "1"]) == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------------
# weighted lists and components


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def half_or_none(completions, answer, **kwargs):
    return [None if a == "skip" else 0.5 for a in answer]


def test_weighted_rewards_add_up_and_every_component_is_kept():
    rewards = RewardSet.from_config(RewardConfig(funcs=["arithmetic", "tests.unit.rewards.test_rewards:length",
                                                        "tests.unit.rewards.test_rewards:half_or_none"],
                                                 weights=[2.0, 0.1, -1.0]))
    assert rewards.names == ["arithmetic", "length", "half_or_none"]
    (a, b), (c,) = rewards.score([({"text": "1+1=", "answer": "2"}, [_completion("2"), _completion("3", ids=[1])]),
                                  ({"text": "2+2=", "answer": "skip"}, [_completion("44", finish_reason="length")])])
    # "2" for "2": arithmetic 1 (exact), length 1, half_or_none 0.5 -> 2*1 + 0.1*1 - 0.5
    assert a[0] == pytest.approx(2 * 1.0 + 0.1 * 1 - 1.0 * 0.5)
    assert a[1] == {"arithmetic": 1.0, "exact": 1.0, "prefix": 1.0, "stopped": 1.0, "length": 1.0,
                    "half_or_none": 0.5}
    assert b[0] == pytest.approx(2 * 0.0 + 0.1 * 1 - 0.5) and b[1]["arithmetic"] == 0.0
    # half_or_none returned None: left out of the sum and of the components (TRL's nansum)
    assert c[0] == pytest.approx(2 * 0.0 + 0.1 * 2) and "half_or_none" not in c[1] and c[1]["stopped"] == 0.0


def test_a_completion_no_function_scores_is_marked_unscored():
    (group,) = RewardSet([half_or_none]).score([({"answer": "skip"}, [_completion("x")])])
    assert group == [(0.0, {UNSCORED: 1.0})]


def test_reward_config_checks_and_the_old_string_form():
    with pytest.raises(ValueError, match="reward.weights has 1 values for 2 reward.funcs"):
        RewardConfig(funcs=["math", "format"], weights=[1.0])
    spec = "asyncrl.rewards.builtin:arithmetic_reward"
    assert WorkerConfig(reward=spec).reward.funcs == [spec]
    cfg = WorkerConfig(reward=RewardConfig(funcs=["math"], weights=[0.5]))
    assert from_dict(WorkerConfig, to_dict(cfg)).reward == cfg.reward  # travels to workers as JSON
    with pytest.raises(ValueError, match="must be one of"):
        RewardSet.from_config(RewardConfig(funcs=["no_such_reward"]))
    with pytest.raises(ValueError, match="unique"):
        RewardSet([length, length])


# ---------------------------------------------------------------------------------------------------------------------
# async functions run concurrently, on one loop


def test_async_rewards_run_concurrently_across_the_batch_on_one_loop():
    groups, group_size = 4, 3
    barrier: list[asyncio.Barrier] = []
    loops = set()

    async def judge(prompts, completions, **kwargs):
        loops.add(id(asyncio.get_running_loop()))
        if not barrier:
            barrier.append(asyncio.Barrier(2 * groups))  # every group of both async functions at once
        # released only when all 2 * groups calls wait here together; run one after another, none would return
        await asyncio.wait_for(barrier[0].wait(), timeout=30)
        return [1.0] * len(completions)

    async def judge2(prompts, completions, **kwargs):
        return await judge(prompts, completions)

    rewards = RewardSet([judge, judge2])
    batch = [({"text": str(g)}, [_completion("a")] * group_size) for g in range(groups)]
    for _ in range(2):  # a second batch reuses the loop
        barrier.clear()
        out = rewards.score(batch)
        assert all(not isinstance(g, RewardError) for g in out), out
        assert [len(g) for g in out] == [group_size] * groups and out[0][0] == (2.0, {"judge": 1.0, "judge2": 1.0})
    assert len(loops) == 1  # one event loop per RewardSet (per worker), not one asyncio.run per group
    rewards.close()


# ---------------------------------------------------------------------------------------------------------------------
# a raising reward fails that lease only


def picky(prompts, completions, bad=None, **kwargs):
    if bad is not None and any(bad):  # the column of the bad prompt (None for the others)
        raise ZeroDivisionError("this prompt breaks the reward")
    return [1.0] * len(completions)


async def picky_async(prompts, completions, **kwargs):
    return picky(prompts, completions, **kwargs)


def _lease(i: int, bad: bool = False) -> ReceivedLease:
    return ReceivedLease(conn=0, lease_id=i, epoch=0, prompt_index=i, group_size=2,
                         prompt={"text": f"{i}+0=", "answer": str(i), **({"bad": True} if bad else {})},
                         policy_version=0)


@pytest.mark.parametrize("fn", [picky, picky_async])
def test_a_raising_reward_fails_its_lease_only_and_the_worker_keeps_serving(fn):
    sender = FakeSender()
    worker = RolloutWorker("w0", build_engine(FakeEngineConfig()), RewardSet([fn]), sender, max_batch=4)
    generated = []
    original = worker.engine.generate
    worker.engine.generate = lambda requests: generated.append(len(requests)) or original(requests)
    worker.step([_lease(1), _lease(2, bad=True), _lease(3)])
    assert [lid for lid, _ in sender.groups] == [1, 3]
    assert [lid for lid, _ in sender.failed] == [2] and worker.lease_failures == 1
    error = sender.failed[0][1]
    assert f"reward function '{fn.__name__}' raised ZeroDivisionError: this prompt breaks the reward" in error
    assert generated == [3]  # the batch was generated once: nothing regenerated for the reward's failure
    worker.step([_lease(4)])  # still serving
    assert [lid for lid, _ in sender.groups] == [1, 3, 4]
    assert all(r.reward == 1.0 and r.reward_components == {fn.__name__: 1.0} for r in sender.groups[0][1].rollouts)


# ---------------------------------------------------------------------------------------------------------------------
# components reach the batch, the debug record and the logged means


def test_components_are_collated_recorded_and_averaged():
    from asyncrl.debug.record import step_record
    from asyncrl.rewards import component_means
    from asyncrl.rollout import Group, Rollout
    from datapipes.collate import collate_groups

    def rollout(sample: int, components: dict) -> Rollout:
        return Rollout(epoch=0, prompt_index=0, sample_index=sample, worker_id="w0", policy_version=0,
                       prompt_ids=torch.tensor([1], dtype=torch.int32), response_ids=torch.tensor([2, 3], dtype=torch.int32),
                       logprobs=torch.tensor([-0.5, -0.5]), reward=1.0, reward_components=components)

    # the second rollout's judge returned None: no "judge" component there
    group = Group(epoch=0, prompt_index=0, rollouts=[rollout(0, {"judge": 1.0, "format": 0.0}), rollout(1, {"format": 1.0})])
    batch = collate_groups([group])
    assert batch["reward_components"]["format"].tolist() == [0.0, 1.0]
    judge = batch["reward_components"]["judge"]
    assert judge[0] == 1.0 and judge[1].isnan()
    assert component_means(batch["reward_components"]) == {"format": 0.5, "judge": 1.0}  # over the rows it scored
    record = step_record(step=1, rank=0, policy_version=0, batch=batch, trainer_logprobs=batch["rollout_logprobs"],
                         advantages=torch.zeros(2), accepted=True, guard_reason="", loss=0.0, grad_norm=0.0,
                         update_ratio=0.0)
    assert record["dist"]["reward/judge"]["n"] == 1 and record["dist"]["reward/judge"]["nonfinite"] == 0
    assert record["dist"]["reward/format"]["mean"] == 0.5


def test_reward_weights_by_logged_name():
    from asyncrl.config import RewardConfig
    from asyncrl.rewards import reward_weights

    assert reward_weights(RewardConfig(funcs=["math", "format"], weights=[1.0, 0.25])) == {"math": 1.0, "format": 0.25}
    assert reward_weights(RewardConfig(funcs=["asyncrl.rewards.builtin:fake_reward"])) == {"fake_reward": 1.0}

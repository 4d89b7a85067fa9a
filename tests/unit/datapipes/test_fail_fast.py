"""Every mistake a newcomer makes is named where it is made, with the fix, before any socket or worker process
exists: a misspelt key, a real engine without a weight channel, a model path that is not a model, a reward that
cannot be imported or fails on a sample, a batch larger than the shard, groups of one, an unknown culprit's poisoned
prompt, a republished version. In-process: the loader's receiver and launcher are replaced by tripwires."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest
import torch

from asyncrl import HFEngineConfig, LoaderConfig, LossConfig, RolloutLoader, WeightSyncConfig, WorkerConfig
from asyncrl.config import RewardConfig, load_config
from asyncrl.models.loading import ModelDirError, check_model_dir
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.pool.poison import PoisonedPromptError
from asyncrl.rewards.preflight import RewardCheckError, reward_columns, try_rewards, worker_env
from asyncrl.rewards.reward_set import RewardSet
from asyncrl.train.losses import compute_loss
from asyncrl.weights._staging import check_publish
from datapipes.preflight import check_loader

PROMPTS = [{"text": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]


@pytest.fixture
def tripwires(monkeypatch):
    """A loader that gets past its checks fails the test: no socket is bound, no worker process starts."""

    def socket(*args, **kwargs):
        raise AssertionError("a socket was opened before the mistake was refused")

    def launcher(*args, **kwargs):
        raise AssertionError("a worker process was started before the mistake was refused")

    monkeypatch.setattr("datapipes.loader.setup_rollout_receiver", socket)
    monkeypatch.setattr("datapipes.loader.LocalWorkerLauncher", launcher)


@pytest.fixture
def model_dir(tmp_path):
    """A model directory as far as a path check can tell: config.json with a model_type, a readable safetensors."""
    from safetensors.numpy import save_file

    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A directory on this process's import path holding ``my_rewards.py``; returns a writer for its source."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        sys.modules.pop("my_rewards", None)
        (tmp_path / "my_rewards.py").write_text(textwrap.dedent(source))
        return str(tmp_path)

    yield write
    sys.modules.pop("my_rewards", None)


def hf_worker(model: str | None, weights: str = "shm", reward: str = "arithmetic") -> WorkerConfig:
    return WorkerConfig(engine=HFEngineConfig(model=model), reward=reward,
                        weights=WeightSyncConfig(type=weights, address="/dev/shm/x" if weights != "none" else None))


# -- configuration keys ------------------------------------------------------------------------------------------------


def test_a_misspelt_key_names_the_closest_one():
    with pytest.raises(ValueError, match=r"rollout\.max_stalenes: did you mean rollout\.max_staleness\?"):
        load_config(None, ["rollout.max_stalenes=0"])
    with pytest.raises(ValueError, match=r"key rolout: did you mean rollout\?"):
        load_config(None, ["rolout.num_workers=1"])
    with pytest.raises(ValueError, match=r"rollout\.worker\.reward\.fucns: did you mean rollout\.worker\.reward\.funcs"):
        load_config(None, ["rollout.worker.reward.fucns=[math]"])
    with pytest.raises(ValueError, match=r"key zzz \(known: checkpoint"):  # nothing close: the known keys
        load_config(None, ["zzz=1"])


def test_a_misspelt_loader_keyword_is_refused_before_a_socket(tripwires):
    with pytest.raises(ValueError, match=r"batchsize: did you mean batch_size\?"):
        RolloutLoader(PROMPTS, batchsize=4)


# -- the loader's checks -----------------------------------------------------------------------------------------------


def test_a_real_engine_without_a_weight_channel_is_refused_at_construction(tripwires, model_dir):
    config = LoaderConfig(num_workers=1, batch_size=2, worker=hf_worker(str(model_dir), weights="none"))
    with pytest.raises(ValueError) as info:
        RolloutLoader(PROMPTS, config)
    message = str(info.value)
    assert "LoaderConfig.worker.engine.type='hf' with LoaderConfig.worker.weights.type='none'" in message
    assert "dropped as stale" in message and "waits for ever" in message
    for fix in ("Give the workers a weight channel", "LoaderConfig.max_staleness=None", "frozen_workers=True"):
        assert fix in message
    # the opt-outs pass the check (and the fake engine, which follows the pool's version, never needs one)
    for opt_out in ({"frozen_workers": True}, {"max_staleness": None}):
        check_loader(LoaderConfig(num_workers=1, batch_size=2, worker=hf_worker(str(model_dir), weights="none"),
                                  **opt_out), PROMPTS, shard_size=8, world_size=1)
    check_loader(LoaderConfig(num_workers=1, batch_size=2), PROMPTS, shard_size=8, world_size=1)


def test_waiting_for_a_group_has_a_finite_default_in_the_loader_and_in_the_recipe():
    # None (wait for ever) was the default: the README's loop with no weight channel hung after two batches
    assert LoaderConfig().wait_timeout_s == 600
    assert load_config(None, []).rollout.wait_timeout_s is not None


def test_the_recipe_refuses_a_real_engine_without_weights_naming_its_own_key():
    with pytest.raises(ValueError, match=r"weights\.type='none' with rollout\.worker\.engine\.type=hf.*weights\.type=shm"):
        load_config(None, ["weights.type=none", "rollout.worker.engine.type=hf"])


@pytest.mark.parametrize(("model", "expected"), [
    (None, r"LoaderConfig\.worker\.engine\.model is not set.*asyncrl tiny-model DIR"),
    ("/nonexistent/model", r"engine\.model='/nonexistent/model': no such directory"),
    ("empty", r"is not a model directory: it has no config\.json \(it holds nothing\)"),
    ("weightless", r"has a config\.json but no weights"),
    ("truncated", r"model\.safetensors is not a readable safetensors file.*truncated"),
    ("sharded", r"model\.safetensors\.index\.json names 1 weight files that are not there"),
], ids=["unset", "missing", "no-config", "no-weights", "truncated", "missing-shard"])
def test_an_engine_model_that_is_not_a_model_is_refused_at_construction(tripwires, tmp_path, model_dir, model,
                                                                       expected):
    if model in ("empty", "weightless", "truncated", "sharded"):
        path = tmp_path / model
        path.mkdir()
        if model != "empty":
            (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        if model == "truncated":
            (path / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:20])
        if model == "sharded":
            (path / "model-1.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
            (path / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}))
        model = str(path)
    with pytest.raises(ModelDirError, match=expected):
        RolloutLoader(PROMPTS, LoaderConfig(num_workers=1, batch_size=2, worker=hf_worker(model)))


def test_a_hub_id_passes_only_if_it_can_be_loaded(monkeypatch, model_dir):
    check_model_dir(str(model_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelDirError, match=r"model\.path='no-org/no-such-model': no such directory.*nor a model of "
                                            r"that id in the Hugging Face cache \(HF_HUB_OFFLINE=1"):
        check_model_dir("no-org/no-such-model", key="model.path")


def test_the_recipe_checks_its_model_path_before_anything_starts(monkeypatch, tmp_path):
    from recipes import grpo

    def prestart(*args, **kwargs):
        raise AssertionError("the workers were prestarted before the model path was checked")

    monkeypatch.setattr(grpo.RolloutLoader, "prestart_workers", prestart)
    monkeypatch.setattr(grpo, "GRPORecipe", prestart)
    with pytest.raises(ModelDirError, match=r"model\.path='.*nowhere': no such directory"):
        grpo.main(["--config", "recipes/configs/tiny_cpu.yaml", f"model.path={tmp_path / 'nowhere'}"])


def test_a_batch_larger_than_the_shard_is_refused(tripwires):
    with pytest.raises(ValueError, match=r"LoaderConfig\.batch_size=8 groups is more than this rank's shard of the "
                                         r"prompts: 3 \(6 prompts over 2 ranks\).*at most 3 groups"):
        RolloutLoader(PROMPTS[:6], batch_size=8, rank=0, world_size=2)


# -- rewards -----------------------------------------------------------------------------------------------------------


def test_a_reward_that_cannot_be_imported_is_refused_before_any_worker(tripwires):
    config = LoaderConfig(num_workers=1, batch_size=2, worker=WorkerConfig(reward="no_such_module:score"))
    with pytest.raises(RewardCheckError, match=r"LoaderConfig\.worker\.reward\.funcs: reward function "
                                               r"'no_such_module:score': cannot import module 'no_such_module'.*"
                                               r"working directory.*run file's directory.*PYTHONPATH"):
        RolloutLoader(PROMPTS, config)
    with pytest.raises(RewardCheckError, match=r"reward\.funcs: reward function 'asyncrl\.rewards:nope': "
                                               r"asyncrl\.rewards has no callable 'nope'"):
        try_rewards(RewardConfig(funcs=["asyncrl.rewards:nope"]), PROMPTS[0], key="rollout.worker.reward")


@pytest.mark.parametrize(("source", "expected"), [
    ("def score(completions, answer, **kw):\n    return [1 / 0 for _ in completions]\n",
     r"reward function 'score' raised ZeroDivisionError: division by zero \(at .*my_rewards\.py:2\)"),
    ("def score(completions, **kw):\n    return [1.0, 2.0]\n",
     r"reward function 'score' returned 2 values for 1 completions"),
    ("def score(completions, **kw):\n    return ['high' for _ in completions]\n",
     r"reward function 'score' returned a non-finite or non-numeric value: 'high'"),
], ids=["raises", "wrong-count", "not-a-number"])
def test_a_reward_is_called_once_on_a_sample_before_any_worker(tripwires, reward_module, source, expected):
    reward_module(source)
    config = LoaderConfig(num_workers=1, batch_size=2, worker=WorkerConfig(reward="my_rewards:score"))
    with pytest.raises(RewardCheckError, match=r"LoaderConfig\.worker\.reward: tried on a sample before any worker "
                                               r"started \(the prompts, the first prompt, with the completion '1'\): "
                                               + expected):
        RolloutLoader(PROMPTS, config)


def test_a_reward_reading_a_column_the_prompts_lack_is_refused(tripwires, reward_module):
    reward_module("def score(completions, solution, **kw):\n    return [1.0 for _ in completions]\n")
    config = LoaderConfig(num_workers=1, batch_size=2, worker=WorkerConfig(reward="my_rewards:score"))
    with pytest.raises(RewardCheckError, match=r"the reward function 'score' reads column 'solution', which the prompts "
                                               r"do not have \(the prompts, the first prompt: its columns are "
                                               r"\['answer', 'text'\]\)"):
        RolloutLoader(PROMPTS, config)


def test_a_sound_reward_passes_with_the_sample_s_answer_as_its_completion(reward_module):
    reward_module("""
        CALLS = []
        def score(prompts, completions, completion_ids, answer, **kw):
            CALLS.append((prompts, completions, completion_ids, answer))
            return [float(c == a) for c, a in zip(completions, answer)]
    """)
    try_rewards(RewardConfig(funcs=["my_rewards:score", "arithmetic"]), PROMPTS[2])
    assert sys.modules["my_rewards"].CALLS == [(["2+1="], ["3"], [[]], ["3"])]
    for builtin in ("fake", "arithmetic", "format"):  # the built-ins pass on a plain item
        try_rewards(RewardConfig(funcs=[builtin]), PROMPTS[0])


def test_the_columns_a_reward_requires_are_read_off_its_signature(reward_module):
    reward_module("""
        def score(prompts, completions, completion_ids, answer, metadata=None, *, unit, **kw):
            return [0.0 for _ in completions]
        def legacy(prompts, completions):
            return [0.0 for _ in completions]
    """)
    columns = reward_columns(RewardConfig(funcs=["my_rewards:score", "my_rewards:legacy", "arithmetic", "math"]))
    assert columns == {"answer": "the reward function 'score'", "unit": "the reward function 'score'"}


def test_workers_import_a_reward_from_where_the_trainer_did(reward_module, monkeypatch, tmp_path):
    directory = reward_module("def score(completions, **kw):\n    return [0.0 for _ in completions]\n")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path.parent)  # not the reward's directory: a worker would not find it there
    assert worker_env(RewardConfig(funcs=["my_rewards:score"])) == {"PYTHONPATH": directory}
    assert worker_env(RewardConfig(funcs=["arithmetic", "email.utils:formatdate"])) == {}  # built in, installed
    monkeypatch.chdir(tmp_path)  # the working directory is searched by a worker already
    assert worker_env(RewardConfig(funcs=["my_rewards:score"])) == {}


# -- the loss: groups of one -------------------------------------------------------------------------------------------


def test_groups_of_one_are_refused_by_the_recipe_and_by_compute_loss():
    with pytest.raises(ValueError, match=r"rollout\.group_size=1: .*loss and gradient 0.*rollout\.group_size to 2"):
        load_config(None, ["rollout.group_size=1"])
    load_config(None, ["rollout.group_size=1", "loss.fn=my_losses:loss"])  # a loss of one's own may not need groups
    batch = {"rewards": torch.tensor([1.0, 0.0, 1.0]), "group_index": torch.tensor([0, 1, 2]),
             "loss_mask": torch.ones(3, 2, dtype=torch.bool), "rollout_logprobs": torch.zeros(3, 2),
             "token_versions": torch.zeros(3, 2, dtype=torch.long), "finish_reasons": ["stop"] * 3}
    logp = torch.zeros(3, 2, requires_grad=True)
    with pytest.raises(ValueError, match=r"every group of this batch has one rollout \(group_size=1\).*"
                                         r"LoaderConfig\.group_size; rollout\.group_size in a run file"):
        compute_loss(batch, logp, config=LossConfig())
    pairs = {**batch, "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]), "group_index": torch.tensor([0, 0, 1, 1]),
             "loss_mask": torch.ones(4, 2, dtype=torch.bool), "rollout_logprobs": torch.zeros(4, 2),
             "token_versions": torch.zeros(4, 2, dtype=torch.long), "finish_reasons": ["stop"] * 4}
    compute_loss(pairs, torch.zeros(4, 2, requires_grad=True), config=LossConfig())


# -- poisoned prompts: the culprit and the key of the context ----------------------------------------------------------


@pytest.mark.parametrize(("config_key", "skip"), [("LoaderConfig", "LoaderConfig.on_poisoned_prompt='skip'"),
                                                  ("rollout", "rollout.on_poisoned_prompt=skip")])
@pytest.mark.parametrize(("culprit", "blame"), [("reward", "a reward function raised"),
                                                ("engine", "the engine failed to generate"),
                                                ("decode", "token ids into text failed"),
                                                ("bogus", "does not say what failed")])
def test_the_poisoned_prompt_error_names_the_culprit_and_the_key_of_its_context(config_key, skip, culprit, blame):
    pool = RolloutPool(PromptLedger(2, seed=0), group_size=2, capacity=2, max_prompt_failures=2,
                       failure_backoff_s=0.0, config_key=config_key)
    pool.start_epoch(0)
    for now in (100.0, 200.0):
        lease = next(lease for lease in pool.grant("w", 2, now=now) if lease.prompt_index == 1)
        pool.lease_failed(lease.lease_id, "w", "ZeroDivisionError: division by zero", now=now,
                          culprit=culprit if culprit != "bogus" else "unknown")
    with pytest.raises(PoisonedPromptError) as info:
        pool.take(timeout=0)
    message = str(info.value)
    assert blame in message and skip in message and f"{config_key}.max_prompt_failures" in message
    assert "ZeroDivisionError: division by zero" in message and "loader.on_poisoned_prompt" not in message
    import pickle

    assert str(pickle.loads(pickle.dumps(info.value))) == message  # travels between processes whole


def test_a_failed_decode_is_blamed_on_decoding_not_on_the_reward():
    class Completion:
        text, response_ids, finish_reason = None, torch.tensor([1, 2]), "stop"

    def decode(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    rewards = RewardSet([lambda completions, **kw: [1.0 for _ in completions]], names=["exact"])
    (error,) = rewards.score([({"text": "q"}, [Completion()])], decode=decode)
    assert error.culprit == "decode" and "decoding a completion's token ids into text for reward function 'exact'" in (
        str(error))
    (error,) = RewardSet([lambda completions, **kw: [1 / 0]], names=["exact"]).score(
        [({"text": "q"}, [Completion()])], decode=lambda ids: "x")
    assert error.culprit == "reward" and "reward function 'exact' raised ZeroDivisionError" in str(error)


# -- weights: republishing after a loader was rebuilt ------------------------------------------------------------------


def test_republishing_a_version_points_to_the_rebuilt_loader_pattern():
    with pytest.raises(ValueError, match=r"version=3 must be greater than the last published version 3: .*"
                                         r"incarnation=old_loader\.incarnation.*version=3, publish_initial=False"):
        check_publish({}, 3, 3, "full", None)

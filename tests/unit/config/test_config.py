"""asyncrl.config: one import point; engine configs chosen by ``type``; renamed keys refused with their new name;
one override grammar (YAML values) for the recipe and the worker command; the shipped run files are current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import asyncrl.config as config
from asyncrl.config import (
    EngineConfig,
    FakeEngineConfig,
    HFEngineConfig,
    LoaderConfig,
    RecipeConfig,
    RewardConfig,
    VllmEngineConfig,
    WorkerConfig,
    apply_overrides,
    from_dict,
    load_config,
    to_dict,
)
from asyncrl.config.renames import MOVED_REWARDS, RENAMED

CONFIGS = sorted((Path(__file__).parents[3] / "recipes" / "configs").glob("*.yaml"))


def test_every_config_class_is_importable_from_asyncrl_config():
    sections = {"Loader", "Transport", "Gate", "Worker", "Reward", "WeightSync", "Data", "Guard", "Loss", "Debug",
                "Model", "Train", "Lora", "Checkpoint", "Recipe", "Testing", "Fault", "Engine", "HFEngine",
                "VllmEngine", "FakeEngine"}
    assert {f"{s}Config" for s in sections} <= set(config.__all__)
    assert all(dataclasses.is_dataclass(getattr(config, f"{s}Config")) for s in sections)


@pytest.mark.parametrize("kind, cls", [("fake", FakeEngineConfig), ("hf", HFEngineConfig), ("vllm", VllmEngineConfig)])
def test_the_engine_type_picks_the_class_and_survives_the_trip_to_a_worker(kind, cls):
    worker = from_dict(WorkerConfig, {"engine": {"type": kind, "max_new_tokens": 7}})
    assert type(worker.engine) is cls and worker.engine.type == kind and worker.engine.max_new_tokens == 7
    assert from_dict(WorkerConfig, to_dict(worker)) == worker  # the JSON a local worker is started with
    assert type(from_dict(WorkerConfig, {}).engine) is FakeEngineConfig  # no type: the fake engine, as before


def test_each_engine_type_has_only_its_own_fields():
    hf, vllm, fake = (set(c.__dataclass_fields__) for c in (HFEngineConfig, VllmEngineConfig, FakeEngineConfig))
    assert {"gpu_memory_utilization", "kv_cache_bytes", "tensor_parallel_size"} <= vllm - hf - fake
    assert {"device", "quantization", "compile", "seed_per_prompt"} <= hf - vllm - fake
    assert {"seconds_per_token", "weight_load_s", "vocab_size"} <= fake - hf - vllm
    assert {"model", "dtype", "ignore_eos"} <= (hf & vllm) - fake
    with pytest.raises(ValueError, match="gpu_memory_utilization is a vllm engine field; this engine is type hf"):
        load_config(None, ["rollout.worker.engine.type=hf", "rollout.worker.engine.gpu_memory_utilization=0.5"])
    with pytest.raises(ValueError, match="seconds_per_token is a fake engine field; this engine is type vllm"):
        from_dict(WorkerConfig, {"engine": {"type": "vllm", "seconds_per_token": 0.1}})
    with pytest.raises(ValueError, match="type='tpu' is not one of"):
        from_dict(WorkerConfig, {"engine": {"type": "tpu"}})
    with pytest.raises(TypeError, match="base of the engine configs"):
        EngineConfig()
    with pytest.raises(ValueError, match="engine.type='vllm' on a HFEngineConfig"):
        HFEngineConfig(type="vllm")


@pytest.mark.parametrize("override, new", [
    ("loss.clip_low=0.1", "loss.epsilon"),
    ("reward.funcs=[fake]", "rollout.worker.reward"),
    ("train.pause_after_step=3", "testing.pause_after_step"),
    ("train.pause_in_save_point=marked", "testing.pause_in_save_point"),
    ("guard.inject_nan_at_step=2", "testing.inject_nan_at_step"),
    ("rollout.worker.fault.kind=nan_logprobs", "testing.worker_fault"),
])
def test_a_renamed_key_fails_with_its_new_name(override, new):
    with pytest.raises(ValueError, match=f"was renamed .*: use {new}"):
        load_config(None, [override])


def test_the_renames_table_names_real_keys():
    """Every old key is gone from its class, and every new name is a key of the run file."""
    classes = {c.__name__: c for c in vars(config).values() if dataclasses.is_dataclass(c)}
    for (owner, old), new in RENAMED.items():
        assert old not in classes[owner].__dataclass_fields__, (owner, old)
        section: type = RecipeConfig
        *parents, leaf = new.split()[0].split(".")
        for part in parents:
            section = type(section.__dataclass_fields__[part].default_factory())
        assert leaf in section.__dataclass_fields__, new
    for spec, name in MOVED_REWARDS.items():
        with pytest.raises(ValueError, match=f"moved: use '{name}'"):
            RewardConfig(funcs=[spec])


def test_the_testing_section_carries_every_test_knob_to_the_workers():
    cfg = load_config(None, ["testing.pause_after_step=3", "testing.worker_fault.kind=nan_logprobs"])
    assert cfg.testing.pause_after_step == 3 and cfg.testing.worker_fault.kind == "nan_logprobs"
    user_sections = (cfg.train, cfg.guard, cfg.rollout.worker)
    assert not any("pause" in f or "inject" in f or f == "fault" for s in user_sections for f in s.__dataclass_fields__)


def test_one_override_grammar_yaml_values():
    tree = apply_overrides({"worker": {}}, ["worker.slots=8", "a.lr=1e-4", "a.ids=[1, 2]", "a.fn=pkg.mod:fn",
                                            "a.flag=true", "a.none=null", "a.path=tcp://127.0.0.1:5555"])
    assert tree == {"worker": {"slots": 8}, "a": {"lr": "1e-4", "ids": [1, 2], "fn": "pkg.mod:fn", "flag": True,
                                                  "none": None, "path": "tcp://127.0.0.1:5555"}}
    assert from_dict(LoaderConfig, {"transport": {"heartbeat_s": tree["a"]["lr"]}}).transport.heartbeat_s == 1e-4
    with pytest.raises(SystemExit, match="must be KEY=VALUE"):
        apply_overrides({}, ["worker.slots"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_run_files_use_current_keys_and_their_own_reward(path):
    tree = yaml.safe_load(path.read_text())
    assert "reward" not in tree and isinstance(tree["rollout"]["worker"]["reward"], dict)
    cfg = load_config(str(path), [])
    funcs = cfg.rollout.worker.reward.funcs
    assert not any(f.startswith("workers.") for f in funcs)
    if cfg.data.source.startswith("visual"):
        assert funcs == ["visual"]

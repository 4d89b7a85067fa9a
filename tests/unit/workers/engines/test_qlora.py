"""QLoRA (asyncrl.models.qlora): the 4-bit NF4 base that the trainer and the HF engine both load, adapter-only sync,
the update guard on the adapter, adapter-only checkpoints with the base referenced by hash, and the refusals.

Thresholds: on the 4-bit base (fp32 compute) the engine's sampled-token logprobs equal the trainer's
recomputation within ``tests.engine_utils.TOL`` = 1e-4, as on a full-precision base; the 4-bit base itself is
far from the full-precision model (|dlogp| > 1e-2 on the same tokens), so an engine that silently served the
full-precision base would fail the check.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from asyncrl.checkpoint.checkpointer import BASE, MODEL, OPTIM, BaseMismatch, Checkpointer
from asyncrl.config import EngineConfig, GuardConfig, HFEngineConfig, from_dict
from asyncrl.models.qlora import (
    FSDP2_REFUSAL,
    VLLM_REFUSAL,
    base_reference,
    is_quantized,
    load_quantized_base,
    parameter_bytes,
)
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.guard import UpdateGuard
from asyncrl.weights.base import WeightUpdate
from asyncrl.weights.state import policy_state
from tests.engine_utils import PROMPTS, SAMPLING, TOL, load_model, max_logprob_diff
from workers.engines import GenerationRequest, build_engine

bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install -e '.[qlora]')")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("qlora") / "tiny"))


def adapter_model(model_dir: str, *, seed: int = 0) -> torch.nn.Module:
    """The trainer's QLoRA policy: the 4-bit base with a LoRA adapter whose B is nonzero (as after training)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_quantized_base(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def lora_update(model: torch.nn.Module, version: int = 1) -> WeightUpdate:
    """What the recipe publishes for a QLoRA policy: policy_state's ``lora`` mode."""
    with policy_state(model, "lora") as state:
        tensors = {name: state[name].clone() for name in state}
        return WeightUpdate(version=version, mode="lora", tensors=tensors, lora_config=state.lora_config)


class _Loader:
    """The loader interface the Checkpointer saves (a state dict)."""

    def __init__(self) -> None:
        self.state = {"cursor": 3}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


# ----------------------------------------------------------------------------------------------------------------------
# the base


def test_base_is_4bit_frozen_and_identical_on_every_load(model_dir):
    base = load_quantized_base(model_dir)
    attn = base.model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "Linear4bit" and type(base.lm_head) is torch.nn.Linear  # head stays full
    assert is_quantized(base) and not is_quantized(load_model(model_dir))
    assert not any(p.requires_grad for p in base.parameters())
    assert all(p.dtype == torch.float32 for p in base.parameters() if type(p).__name__ != "Params4bit")
    again = base_reference(load_quantized_base(model_dir), model_dir)
    ref = base_reference(base, model_dir)
    assert ref == again  # deterministic quantization: the trainer and every engine hold the same bytes
    assert len(ref["identity"]["weights_sha256"]) == 64 and ref["about"]["bitsandbytes"] == bnb.__version__
    sizes = parameter_bytes(base)
    full = sum(t.numel() * t.element_size() for t in load_model(model_dir).state_dict().values())
    print(f"parameter bytes: 4-bit base {sizes}, full precision {full}")
    assert sizes["trainable"] == 0 and 0 < sizes["quantized"] < sizes["frozen"] < full


def test_engine_holds_the_trainers_4bit_base_and_logprobs_agree(model_dir):
    trainer = adapter_model(model_dir)
    engine = build_engine(HFEngineConfig(model=model_dir, seed=3, max_new_tokens=12, lora_rank=8,
                                       quantization="nf4", **SAMPLING))
    try:
        assert base_reference(engine.model, model_dir) == base_reference(load_quantized_base(model_dir), model_dir)
        engine.apply_weights(lora_update(trainer))
        requests = [GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=4) for i, p in enumerate(PROMPTS)]
        completions = engine.generate(requests)
    finally:
        engine.close()
    diff = max_logprob_diff(trainer.eval(), completions, **SAMPLING)
    # the same tokens under the full-precision base with the same adapter: the 4-bit base is what both hold
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    unquantized = get_peft_model(load_model(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    set_peft_model_state_dict(unquantized, lora_update(trainer).tensors)
    off = max_logprob_diff(unquantized.eval(), completions, **SAMPLING)
    print(f"max |dlogp| engine vs trainer on the 4-bit base: {diff:.3e}; vs the full-precision base: {off:.3e}")
    assert diff <= TOL
    assert off > 1e-2


def test_a_4bit_engine_refuses_full_updates(model_dir):
    engine = build_engine(HFEngineConfig(model=model_dir, lora_rank=8, quantization="nf4"))
    try:
        state = load_model(model_dir).state_dict()
        with pytest.raises(ValueError, match="takes lora updates only"):
            engine.apply_weights(WeightUpdate(version=1, mode="full", tensors=state))
        assert engine.policy_version == 0
    finally:
        engine.close()


# ----------------------------------------------------------------------------------------------------------------------
# adapter-only sync and the guard


def test_only_the_adapter_is_published(model_dir):
    model = adapter_model(model_dir)
    with policy_state(model, "lora") as state:
        published = state.nbytes
        assert all(".lora_" in name for name in state)
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    full = sum(t.numel() * t.element_size() for t in load_model(model_dir).state_dict().values())
    print(f"bytes per update: adapter {published}, full-precision model {full}")
    assert published == adapter and published < full / 5
    with pytest.raises(ValueError, match="publish mode='lora' instead"):  # no merge into 4-bit weights
        policy_state(model, "full")


def test_guard_measures_the_adapter_and_rejects_a_blown_up_step(model_dir):
    model = adapter_model(model_dir)
    adapter = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapter, lr=1e-4)
    guard = UpdateGuard(model, optimizer, GuardConfig(max_update_ratio=0.05), grad_clip=1.0)
    assert len(guard.params) == len(adapter) == 2 * len(TARGETS) * 2  # A and B, 4 targets, 2 layers
    assert not any(type(p).__name__ == "Params4bit" for p in guard.params)  # the frozen base is not measured
    base_before = base_reference(model, model_dir)
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(0))

    ok = guard.step(model(input_ids=ids, labels=ids).loss)
    assert ok.accepted and 0 < ok.update_ratio < 0.05
    before = [p.detach().clone() for p in adapter]
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    blown = guard.step(model(input_ids=ids, labels=ids).loss, lr=10.0)  # a blown-up adapter step
    assert not blown.accepted and "update_ratio" in blown.reason and blown.update_ratio > 0.05
    assert all(torch.equal(p, b) for p, b in zip(adapter, before))  # undone exactly
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, moments[id(p)][k]) for k, v in s.items())
    assert base_reference(model, model_dir) == base_before  # the base never moved


# ----------------------------------------------------------------------------------------------------------------------
# checkpoints: the adapter and its optimizer state, the base by hash


def _trained(model_dir: str, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = adapter_model(model_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_checkpoint_holds_the_adapter_and_references_the_base(model_dir, tmp_path):
    import torch.distributed.checkpoint as dcp

    model, optimizer = _trained(model_dir)
    ref = base_reference(model, model_dir)
    path = Checkpointer(tmp_path / "ckpt", model, optimizer, _Loader(), base=ref).save(2, 2)
    saved = json.loads((path / BASE).read_text())
    assert saved == json.loads(json.dumps(ref))
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = [k for k in meta if k.startswith(f"{MODEL}.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no base weight, no quantization state
    nbytes = {section: sum(m.size.numel() * 4 for k, m in meta.items() if k.startswith(f"{section}.") and
                           hasattr(m, "size") and len(m.size)) for section in (MODEL, OPTIM)}
    adapter = parameter_bytes(model)["trainable"]
    print(f"checkpoint tensors: {nbytes} (adapter {adapter}); the base it references: {parameter_bytes(model)['frozen']}")
    assert nbytes == {MODEL: adapter, OPTIM: 2 * adapter}  # the adapter and AdamW's two moments of it

    fresh = adapter_model(model_dir, seed=9)  # another adapter, no optimizer state yet
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    state = Checkpointer(tmp_path / "ckpt", fresh, fresh_opt, _Loader(), base=base_reference(fresh, model_dir)).load(path)
    assert (state.step, state.policy_version) == (2, 2)
    trained = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(p, trained[name]), name  # adapter exact; the 4-bit base equal by construction
    exp_avg = [s["exp_avg"] for s in optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, [s["exp_avg"] for s in fresh_opt.state.values()]))


def test_resume_onto_another_base_is_refused(model_dir, tmp_path):
    model, optimizer = _trained(model_dir, steps=1)
    ref = base_reference(model, model_dir)
    path = Checkpointer(tmp_path / "ckpt", model, optimizer, _Loader(), base=ref).save(1, 1)
    other = {**ref, "identity": {**ref["identity"], "weights_sha256": "0" * 64}}
    with pytest.raises(BaseMismatch, match="was trained on another base: weights_sha256="):
        Checkpointer(tmp_path / "ckpt", model, optimizer, _Loader(), base=other).load(path)
    with pytest.raises(BaseMismatch, match="resume it with lora.qlora=true"):
        Checkpointer(tmp_path / "ckpt", model, optimizer, _Loader()).load(path)
    plain = Checkpointer(tmp_path / "plain", model, optimizer, _Loader()).save(1, 1)
    with pytest.raises(BaseMismatch, match="holds the whole model"):
        Checkpointer(tmp_path / "plain", model, optimizer, _Loader(), base=ref).load(plain)


def test_checkpoint_of_a_changed_model_directory_is_refused(model_dir, tmp_path):
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(model_dir, changed)
    from safetensors.torch import load_file, save_file

    weights = load_file(changed / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = weights[name] * 1.01
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    model, optimizer = _trained(model_dir, steps=1)
    path = Checkpointer(tmp_path / "ckpt", model, optimizer, _Loader(), base=base_reference(model, model_dir)).save(1, 1)
    moved = adapter_model(str(changed))
    with pytest.raises(BaseMismatch, match="quantized_sha256=.*weights_sha256="):
        Checkpointer(tmp_path / "ckpt", moved, optimizer, _Loader(), base=base_reference(moved, changed)).load(path)


# ----------------------------------------------------------------------------------------------------------------------
# refusals at config time


def test_refusals_say_why():
    from asyncrl.config import load_config

    with pytest.raises(ValueError, match="lora.qlora=true needs lora.rank > 0"):
        load_config(None, ["lora.qlora=true"])
    with pytest.raises(ValueError, match="train.parallel=fsdp2: QLoRA runs with train.parallel=ddp only"):
        load_config(None, ["lora.qlora=true", "lora.rank=8", "train.parallel=fsdp2"])
    with pytest.raises(ValueError, match="no bitsandbytes quantization method"):
        load_config(None, ["lora.qlora=true", "lora.rank=8", "rollout.worker.engine.type=vllm"])
    with pytest.raises(ValueError, match="engine.type=vllm: vLLM cannot hold the QLoRA base"):
        from_dict(EngineConfig, {"type": "vllm", "model": "m", "quantization": "nf4"})
    assert "bitsandbytes" in VLLM_REFUSAL and "Params4bit" in FSDP2_REFUSAL
    cfg = load_config(None, ["lora.qlora=true", "lora.rank=8", "rollout.worker.engine.type=hf"])
    assert cfg.lora.qlora and cfg.train.parallel == "ddp"
    assert dataclasses.replace(cfg.rollout.worker.engine, quantization="nf4").quantization == "nf4"


def test_a_quantized_model_is_not_given_to_fsdp2(model_dir):
    from asyncrl.train.parallel import parallelize

    with pytest.raises(ValueError, match="Params4bit"):
        parallelize(load_quantized_base(model_dir), "fsdp2", torch.device("cpu"))


def test_debugger_loads_a_qlora_checkpoint(model_dir, tmp_path):
    """asyncrl replay / align's load_policy: the 4-bit base from the model directory, the adapter from the
    checkpoint (configured from the run's config.json, as the recipe writes it)."""
    from asyncrl.debug.align import load_policy

    model, optimizer = _trained(model_dir, steps=1)
    config = {"lora": {"rank": 8, "alpha": 16, "target_modules": TARGETS, "qlora": True}}
    path = Checkpointer(tmp_path / "ckpt", model, optimizer, _Loader(), base=base_reference(model, model_dir)).save(
        1, 1, files={"config.json": json.dumps(config).encode()})
    loaded = load_policy(model_dir, str(path), torch.float32)
    assert is_quantized(loaded)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-6, rtol=0)

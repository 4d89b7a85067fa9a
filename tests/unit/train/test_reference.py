"""The KL's reference policy (asyncrl.train.reference): a frozen copy loaded from a model directory, or a peft policy
with its adapters disabled; its logprobs are the base model's whatever the adapter has learnt."""

from __future__ import annotations

import pytest
import torch

from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import token_logprobs
from asyncrl.train.reference import ReferencePolicy

SAMPLING = {"temperature": 0.9, "top_k": 0, "top_p": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("reference") / "tiny"))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 0, 0]])
    return ids, (ids != 0) | (torch.arange(5) == 0)


def test_a_loaded_reference_is_frozen_and_matches_the_model(model_dir):
    from transformers import AutoModelForCausalLM

    ref = ReferencePolicy.load(model_dir)
    assert not any(p.requires_grad for p in ref.model.parameters()) and not ref.model.training
    ids, attn = _batch()
    expected = token_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), ids, attn, **SAMPLING)
    torch.testing.assert_close(ref.logprobs(ids, attn, **SAMPLING), expected, rtol=0, atol=0)


def test_under_lora_the_reference_is_the_base_with_adapters_disabled(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = token_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), *_batch(), **SAMPLING)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                            LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # the adapter has learnt something: the policy moved away from its base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ref = ReferencePolicy.of_peft(policy)
    trained = token_logprobs(policy, *_batch(), **SAMPLING)
    assert (trained - base).abs().max() > 1e-3
    torch.testing.assert_close(ref.logprobs(*_batch(), **SAMPLING), base, rtol=1e-6, atol=1e-6)
    # the adapters are back on afterwards, and still trainable
    torch.testing.assert_close(token_logprobs(policy, *_batch(), **SAMPLING), trained)
    assert any(p.requires_grad for p in policy.parameters())
    with pytest.raises(TypeError, match="not a peft model"):
        ReferencePolicy.of_peft(AutoModelForCausalLM.from_pretrained(model_dir))

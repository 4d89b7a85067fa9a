"""Tests for workers.engines.hf.HFEngine and asyncrl.train.logprobs: the engine's logprobs are the trainer's.

The core check: prompt + response collated exactly as a trainer sees them (``collate_groups``), then
``token_logprobs`` at the response positions must equal the engine's logprobs within 1e-4 (fp32) —
with temperature/top-k/top-p, after a full weight update, and after a LoRA update.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncrl.config import HFEngineConfig
from asyncrl.testing.tiny_model import build_tiny_model
from asyncrl.train.logprobs import sampling_logprobs, token_logprobs
from asyncrl.weights.base import WeightUpdate
from tests.engine_utils import PROMPTS, SAMPLING, TOL, load_model, lora_update, max_logprob_diff
from workers.engines import Completion, GenerationRequest, build_engine
from workers.engines._rows import length_targets
from workers.engines.hf import HFEngine

EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny"))


def make_engine(model_dir: str, **overrides: Any) -> HFEngine:
    kw = dict(model=model_dir, seed=7, max_new_tokens=16, **SAMPLING)
    return build_engine(HFEngineConfig(**{**kw, **overrides}))


def generate(engine: HFEngine, n: int = 4) -> list[list[Completion]]:
    requests = [GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=n) for i, p in enumerate(PROMPTS)]
    return engine.generate(requests)



# ----------------------------------------------------------------------------------------------------------------------
# logprob alignment


@pytest.mark.parametrize("sampling", [SAMPLING, dict(temperature=1.0, top_k=0, top_p=1.0)], ids=["warped", "plain"])
def test_logprobs_align_with_trainer(model_dir, sampling):
    engine = make_engine(model_dir, **sampling)
    completions = generate(engine)
    assert [len(cs) for cs in completions] == [4, 4, 4]
    for c in (c for cs in completions for c in cs):
        assert c.prompt_ids.dtype == c.response_ids.dtype == torch.int32 and c.logprobs.dtype == torch.float32
        assert c.logprobs.shape == c.response_ids.shape and c.policy_version == 0
        assert torch.isfinite(c.logprobs).all() and (c.logprobs <= 0).all()
    diff = max_logprob_diff(engine.model, completions, **sampling)
    print(f"max |dlogp| ({sampling}) = {diff:.3e}")
    assert diff <= TOL


def test_checkpoint_generation_defaults_are_ignored(model_dir, tmp_path):
    """A checkpoint's generation_config.json (repetition penalty, n-gram bans, its own top-k) must not
    change the sampled distribution: the trainer knows only the engine config's sampling parameters."""
    import json
    import shutil

    local = shutil.copytree(model_dir, tmp_path / "tiny")
    defaults = dict(repetition_penalty=2.0, no_repeat_ngram_size=1, top_k=5, min_new_tokens=8, eos_token_id=EOS)
    (local / "generation_config.json").write_text(json.dumps(defaults))
    engine = make_engine(str(local))
    completions = generate(engine)
    diff = max_logprob_diff(engine.model, completions, **SAMPLING)
    print(f"max |dlogp| with checkpoint generation defaults = {diff:.3e}")
    assert diff <= TOL


def test_token_logprobs_convention(model_dir):
    model = load_model(model_dir)
    ids = torch.tensor([[1, 20, 21, 22], [1, 30, 0, 0]])
    mask = ids != 0
    out = token_logprobs(model, ids, mask)
    assert out.shape == (2, 4) and (out[:, 0] == 0).all() and (out[1, 2:] == 0).all()
    # Right padding must not change a row's values: row 1 alone, unpadded, gives the same logprob.
    alone = token_logprobs(model, ids[1:, :2], mask[1:, :2])
    torch.testing.assert_close(out[1, :2], alone[0], atol=1e-6, rtol=0)
    # grad=True keeps the graph, grad=False does not.
    assert token_logprobs(model, ids, mask, grad=True).requires_grad
    assert not out.requires_grad


def test_sampling_logprobs_filters():
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0]]])
    logp = sampling_logprobs(logits, temperature=0.5, top_k=3, top_p=1.0)
    assert logp.shape == logits.shape and torch.isinf(logp[..., 3:]).all()
    torch.testing.assert_close(logp[..., :3].exp().sum(), torch.tensor(1.0))
    assert torch.isinf(sampling_logprobs(logits, top_p=0.5)[..., 1:]).all()  # softmax(logits)[0] = 0.64 >= 0.5
    with pytest.raises(ValueError, match="temperature=0"):
        sampling_logprobs(logits, temperature=0)


# ----------------------------------------------------------------------------------------------------------------------
# weights


def test_full_update_arrives_and_aligns(model_dir):
    engine = make_engine(model_dir)
    old = load_model(model_dir)
    new = load_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    engine.apply_weights(WeightUpdate(version=1, mode="full", tensors=new.state_dict()))
    completions = generate(engine)
    assert all(c.policy_version == 1 for cs in completions for c in cs)
    diff_new = max_logprob_diff(new, completions, **SAMPLING)
    diff_old = max_logprob_diff(old, completions, **SAMPLING)
    print(f"max |dlogp| after full update: new weights {diff_new:.3e}, old weights {diff_old:.3e}")
    assert diff_new <= TOL
    assert diff_old > 100 * TOL

    with pytest.raises(ValueError, match="is older than"):
        engine.apply_weights(WeightUpdate(version=0, mode="full", tensors=new.state_dict()))
    partial = dict(new.state_dict())
    partial.pop("lm_head.weight")
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        engine.apply_weights(WeightUpdate(version=2, mode="full", tensors=partial))
    assert engine.policy_version == 1


def test_lora_update_aligns_with_merged_model(model_dir):
    engine = make_engine(model_dir, lora_rank=4)
    update, merged = lora_update(model_dir, version=3)
    engine.apply_weights(update)
    completions = generate(engine)
    assert all(c.policy_version == 3 for cs in completions for c in cs)
    diff = max_logprob_diff(merged, completions, **SAMPLING)
    diff_base = max_logprob_diff(load_model(model_dir), completions, **SAMPLING)
    print(f"max |dlogp| after LoRA update: merged {diff:.3e}, base {diff_base:.3e}")
    assert diff <= TOL
    assert diff_base > 100 * TOL

    # A second update with the same config reloads in place; a renamed tensor set is rejected.
    update.version = 4
    engine.apply_weights(update)
    bad = WeightUpdate(version=5, mode="lora", tensors={"x": torch.zeros(1)}, lora_config=update.lora_config)
    with pytest.raises(ValueError, match=r"unexpected \['x'\]"):
        engine.apply_weights(bad)

    # A full update drops the adapter: generations follow the base weights sent.
    base = load_model(model_dir)
    engine.apply_weights(WeightUpdate(version=5, mode="full", tensors=base.state_dict()))
    assert max_logprob_diff(base, generate(engine), **SAMPLING) <= TOL


def test_lora_needs_lora_rank(model_dir):
    engine = make_engine(model_dir)
    update, _ = lora_update(model_dir, version=1)
    with pytest.raises(ValueError, match="engine.lora_rank >= 4, got 0"):
        engine.apply_weights(update)
    assert engine.policy_version == 0


# ----------------------------------------------------------------------------------------------------------------------
# stopping, prompts, seeding


def test_stop_tokens_end_a_response(model_dir):
    stop = list(range(3, 40))
    engine = make_engine(model_dir, stop_token_ids=stop, max_new_tokens=12)
    completions = [c for cs in generate(engine) for c in cs]
    stops = set(stop) | {EOS}
    for c in completions:
        ids = c.response_ids.tolist()
        assert not stops & set(ids[:-1])
        if c.finish_reason == "stop":
            assert ids[-1] in stops
        else:
            assert c.finish_reason == "length" and len(ids) == 12 and ids[-1] not in stops
    assert any(c.finish_reason == "stop" and len(c.response_ids) > 1 and c.response_ids[-1] != EOS for c in completions)


def test_max_new_tokens_gives_length(model_dir):
    engine = make_engine(model_dir, max_new_tokens=3, min_new_tokens=0)
    completions = [c for cs in generate(engine) for c in cs]
    assert any(c.finish_reason == "length" for c in completions)
    for c in completions:
        assert len(c.response_ids) <= 3 and (c.finish_reason == "stop") == (c.response_ids[-1].item() == EOS)


def test_prompts_and_seeding(model_dir):
    a, b = make_engine(model_dir), make_engine(model_dir)
    first, again = generate(a), generate(b)
    for x, y in zip((c for cs in first for c in cs), (c for cs in again for c in cs)):
        assert torch.equal(x.response_ids, y.response_ids) and torch.equal(x.logprobs, y.logprobs)
    second = generate(a)  # the next call draws new samples
    assert any(not torch.equal(x.response_ids, y.response_ids) for x, y in zip(first[0], second[0]))
    # Text is tokenized without special tokens, after the tokenizer's bos; prompt_ids pass through.
    assert first[0][0].prompt_ids.tolist() == [1, *a.tokenizer("hello", add_special_tokens=False).input_ids]
    assert first[1][0].prompt_ids.tolist() == PROMPTS[1]["prompt_ids"]
    with pytest.raises(ValueError, match="'prompt_ids', 'messages', 'prompt' or 'text'"):
        a.generate([GenerationRequest(epoch=0, prompt_index=0, prompt={"other": 1}, n=1)])


# ----------------------------------------------------------------------------------------------------------------------
# ignore_eos and long-tailed lengths (benchmark workloads)

LONG_TAIL = dict(ignore_eos=True, length_tail=1.0, length_median=6, min_new_tokens=2, max_new_tokens=24)


def test_length_targets_are_lognormal_clipped_and_seeded():
    config = HFEngineConfig(model="unused", seed=3, **LONG_TAIL)
    requests = [GenerationRequest(epoch=0, prompt_index=i, prompt="x", n=4) for i in range(500)]
    lengths = [t for r in requests for t in length_targets(config, r, 24)]
    assert min(lengths) == 2 and max(lengths) == 24  # both clips are hit with sigma 1
    assert 5 <= sorted(lengths)[len(lengths) // 2] <= 7  # the median
    assert length_targets(config, requests[7], 24) == length_targets(config, requests[7], 24)  # regenerated: same
    assert length_targets(config, requests[7], 10) == [min(t, 10) for t in length_targets(config, requests[7], 24)]
    chunk = GenerationRequest(epoch=0, prompt_index=0, prompt="x", n=2, max_new_tokens=5)
    assert length_targets(config, chunk, 5) == [5, 5]  # a chunk of an interruptible generation runs to its limit
    flat = HFEngineConfig(model="unused", ignore_eos=True, max_new_tokens=24)
    assert length_targets(flat, requests[0], 24) == [24] * 4


@pytest.mark.parametrize("sampling", [SAMPLING, dict(temperature=1.0, top_k=0, top_p=1.0)], ids=["warped", "plain"])
def test_ignore_eos_lengths_follow_targets_and_logprobs_align(model_dir, sampling):
    stop = list(range(3, 40))  # many stop tokens, so that most responses run past one
    engine = make_engine(model_dir, stop_token_ids=stop, **LONG_TAIL, **sampling)
    requests = [GenerationRequest(epoch=1, prompt_index=i, prompt=p, n=4) for i, p in enumerate(PROMPTS)]
    completions = engine.generate(requests)
    stops = set(stop) | {EOS}
    cut = 0
    for r, cs in zip(requests, completions):
        assert [c.response_ids.numel() for c in cs] == length_targets(engine.config, r, 24)
        for c in cs:
            ids = c.response_ids.tolist()
            end = next((t for t, tok in enumerate(ids) if tok in stops), len(ids))
            assert c.finish_reason == "length" and c.logprobs.shape == c.response_ids.shape
            assert c.text == engine.decode(ids[:end])  # rewards see the answer, not what follows the EOS
            cut += end < len(ids) - 1
    assert cut >= 3, "expected responses that run on past a stop token"
    assert len({c.response_ids.numel() for cs in completions for c in cs}) >= 4
    diff = max_logprob_diff(engine.model, completions, **sampling)
    print(f"max |dlogp| with ignore_eos ({sampling}) = {diff:.3e}")
    assert diff <= TOL


def test_ignore_eos_without_tail_runs_to_the_limit(model_dir):
    engine = make_engine(model_dir, ignore_eos=True, max_new_tokens=10, stop_token_ids=list(range(3, 40)))
    completions = [c for cs in generate(engine) for c in cs]
    assert all(c.response_ids.numel() == 10 and c.finish_reason == "length" for c in completions)
    assert max_logprob_diff(engine.model, [completions], **SAMPLING) <= TOL


@pytest.mark.gpu
def test_logprobs_align_on_cuda(model_dir):
    engine = make_engine(model_dir, device="cuda")
    completions = generate(engine)
    diff = max_logprob_diff(engine.model, completions, **SAMPLING)
    print(f"max |dlogp| on cuda = {diff:.3e}")
    assert diff <= TOL


def test_seed_per_prompt_makes_groups_independent_of_batching(model_dir):
    one = make_engine(model_dir, seed_per_prompt=True)
    other = make_engine(model_dir, seed_per_prompt=True)
    reqs = [GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=3) for i, p in enumerate(PROMPTS)]
    together = one.generate(reqs)
    alone = [other.generate([r])[0] for r in reversed(reqs)][::-1]
    for a, b in zip(together, alone):
        assert [c.response_ids.tolist() for c in a] == [c.response_ids.tolist() for c in b]

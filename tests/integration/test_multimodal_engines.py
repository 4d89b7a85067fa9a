"""Image prompts through a real engine: the HF engine generates from the tiny VLM's image prompts (the visual task)
and the trainer's recomputation on the same weights, from the rollouts' image bytes, matches its logprobs per token
(fp32: 1e-5, as does ``asyncrl align --images``); the image changes the logprobs
(the pixels are used, not only the placeholders); the placeholders stay outside the loss mask. One engine per
module. vLLM: its multimodal models import torchvision-backed processors, absent here: skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from asyncrl.config import DataConfig, HFEngineConfig, VllmEngineConfig
from asyncrl.data.images import image_provenance, processor_inputs
from asyncrl.data.prompts import load_prompts
from asyncrl.data.visual_task import draw_squares
from asyncrl.rollout import Group, Rollout
from asyncrl.testing.tiny_vlm import IMAGE_TOKEN
from asyncrl.train.logprobs import batch_logprobs, token_logprobs
from datapipes.collate import collate_groups
from workers.engines.base import GenerationRequest

pytestmark = pytest.mark.integration

THRESHOLDS = {"float32": 1e-5}
"""Largest |engine - trainer| logprob per token, by dtype (bf16 is not tested with images here; the text models'
bf16 bound, max |d| ~4e-3 on the tiny model, is in asyncrl.debug.align)."""


@pytest.fixture(scope="module")
def engine(tiny_vlm):
    from workers.engines.hf import HFEngine

    return HFEngine(HFEngineConfig(model=tiny_vlm, max_new_tokens=6, temperature=1.0, seed=0))


@pytest.fixture(scope="module")
def prompts(tiny_vlm):
    return load_prompts(DataConfig(source="visual_count", num_prompts=6, seed=1), tiny_vlm)


def _groups(items, completions) -> list[Group]:
    groups = []
    for i, (item, cs) in enumerate(zip(items, completions)):
        meta = {"images": [image_provenance(x) for x in item["images"]]}
        rollouts = [Rollout(epoch=0, prompt_index=i, sample_index=s, worker_id="w", policy_version=0,
                            prompt_ids=c.prompt_ids, response_ids=c.response_ids, logprobs=c.logprobs,
                            metadata=meta, images=list(item["images"]),
                            sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0}) for s, c in enumerate(cs)]
        groups.append(Group(epoch=0, prompt_index=i, rollouts=rollouts))
    return groups


def test_prompts_hold_one_placeholder_per_image_token(prompts, engine):
    image_id = engine.processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for item in prompts:
        assert item["prompt_ids"].count(image_id) == 16 and isinstance(item["images"][0], bytes)


def test_hf_engine_logprobs_match_trainer_recomputation_on_image_prompts(engine, prompts):
    items = list(prompts[:4])
    completions = engine.generate([GenerationRequest(epoch=0, prompt_index=i, n=2, prompt=it)
                                   for i, it in enumerate(items)])
    batch = collate_groups(_groups(items, completions), pad_token_id=engine.pad_id)
    trainer = batch_logprobs(engine.model, batch, processor=engine.processor)
    mask = batch["loss_mask"]
    diff = (trainer - batch["rollout_logprobs"]).abs()[mask]
    assert diff.numel() > 0 and diff.max().item() < THRESHOLDS["float32"], diff.max().item()
    image_id = engine.processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert not mask[batch["input_ids"] == image_id].any()  # placeholders: prompt tokens, never trained on
    with pytest.raises(ValueError, match="pass the model's processor"):
        batch_logprobs(engine.model, batch)


def test_the_image_changes_the_logprobs(engine, prompts):
    item = prompts[0]
    ids = torch.tensor([item["prompt_ids"] + [40, 41]])
    mask = torch.ones_like(ids)
    a = token_logprobs(engine.model, ids, mask, images=processor_inputs(engine.processor, [[draw_squares(1)]]))
    b = token_logprobs(engine.model, ids, mask, images=processor_inputs(engine.processor, [[draw_squares(4)]]))
    assert (a[0, -2:] - b[0, -2:]).abs().max() > 1e-6


def test_corrupted_image_in_a_lease_fails_that_prompt_only(engine, prompts):
    from asyncrl.data.images import ImageError

    good = prompts[1]
    bad = {**prompts[2], "images": [prompts[2]["images"][0][:40]]}
    with pytest.raises(ImageError, match="does not decode"):
        engine.generate([GenerationRequest(epoch=0, prompt_index=2, n=1, prompt=bad)])
    (cs,) = engine.generate([GenerationRequest(epoch=0, prompt_index=1, n=1, prompt=good)])
    assert cs[0].response_ids.numel() > 0


def test_streaming_refuses_image_prompts_with_the_fix(engine, prompts):
    with pytest.raises(ValueError, match="worker.streaming off"):
        engine.submit(0, GenerationRequest(epoch=0, prompt_index=0, n=1, prompt=prompts[0]))
    assert engine.in_flight() == 0


def test_align_with_image_prompts_passes_per_token(tiny_vlm, tmp_path, capsys):
    from asyncrl.codec import loads_json
    from asyncrl.debug.align import main

    out = tmp_path / "align.json"
    rc = main(["--model", tiny_vlm, "--engine", "hf", "--images", "--prompts", "3", "--samples", "2",
               "--max-new-tokens", "4", "--threshold", str(THRESHOLDS["float32"]), "--json", str(out)])
    report = loads_json(out.read_bytes())
    assert rc == 0 and report["passed"] and report["ranks"][0]["tokens"] > 0, capsys.readouterr().out
    assert report["max_abs_diff"] < THRESHOLDS["float32"]


def test_engines_never_sample_image_tokens(engine, prompts):
    from asyncrl.data.images import vision_token_ids

    banned = set(vision_token_ids(engine.processor))
    assert engine.processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) in banned
    completions = engine.generate([GenerationRequest(epoch=0, prompt_index=i, n=4, prompt=it)
                                   for i, it in enumerate(prompts)])
    assert not banned & {t for cs in completions for c in cs for t in c.response_ids.tolist()}


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="vLLM 0.32's multimodal models (llava, qwen2_vl, ...) import transformers' torchvision "
                           "image processors; torchvision does not load against this CPU torch")
def test_vllm_engine_logprobs_match_trainer_on_image_prompts(tiny_vlm, prompts, engine):
    from workers.engines.vllm_engine import VLLMEngine

    vllm = VLLMEngine(VllmEngineConfig(model=tiny_vlm, max_new_tokens=6, temperature=1.0, seed=0))
    try:
        items = list(prompts[:2])
        completions = vllm.generate([GenerationRequest(epoch=0, prompt_index=i, n=2, prompt=it)
                                     for i, it in enumerate(items)])
    finally:
        vllm.close()
    batch = collate_groups(_groups(items, completions), pad_token_id=engine.pad_id)
    trainer = batch_logprobs(engine.model, batch, processor=engine.processor)
    diff = (trainer - batch["rollout_logprobs"]).abs()[batch["loss_mask"]]
    assert diff.max().item() < 1e-4


def test_corrupted_image_from_a_peer_is_refused_counted_and_regenerated():
    """Through the real pool: a rogue worker returns, for every lease it holds, a well-formed group whose image is
    truncated (its provenance matching the broken bytes); each is refused as gate_image_corrupt, its prompt is
    regenerated by the healthy worker, and every prompt of the epoch is consumed exactly once."""
    import hashlib

    from tests.integration.test_gate import _group, rogue_answers_every_lease

    broken = draw_squares(2)[:50]
    provenance = [{"sha256": hashlib.sha256(broken).hexdigest(), "nbytes": len(broken)}]

    def broken_image_group(lease: dict) -> Group:
        group = _group(lease["prompt_index"])
        for r in group.rollouts:
            r.images, r.metadata = [broken], {"images": provenance}
        return group

    _, stats, _, _ = rogue_answers_every_lease(12, broken_image_group, "gate_image_corrupt")
    assert any("does not decode" in e[1] for e in stats["transport"]["recent_errors"])
